"""The online planner: every interval it observes the routers and the node registry, decides
(scaling.py), applies the change (actuator.py), logs the decision as one JSON line and
exports it; its HTTP app serves

    GET /debug/planner   the config, the last decisions (?n=20), the predictors' errors,
                         the actuator's nodes (and device-seconds, locally)
    GET /metrics         splitserve:planner_* (common/metric_names.py), model_name on each
    GET /health

``splitserve planner`` runs it as a process (``run_planner``); ``splitserve up --planner``
runs it on a thread of the launcher (``PlannerThread``), next to the supervisor, with
the cluster as its actuator. Owns its observer, policy, metrics and decision history;
no module globals.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import threading
from collections import deque

import msgspec
from aiohttp import web

from ...common import metric_names as names
from ...common.model_metrics import ModelMetrics
from ...common.outcomes import ScrapeFailure
from .actuator import Actuator, ExportOnly
from .config import PlannerConfig
from .observe import Observation, Observer
from .perf import PoolModel
from .scaling import ROLES, PlanningDecision, Policy

log = logging.getLogger(__name__)


class PlannerMetrics:
    def __init__(self, model: str):
        m = self.m = ModelMetrics({names.MODEL_LABEL: model})
        self.target = m.gauge(names.PLANNER_TARGET_REPLICAS, "nodes the planner wants per role (bounded)", ["role"])
        self.current = m.gauge(names.PLANNER_CURRENT_REPLICAS, "nodes serving or starting per role", ["role"])
        self.observed = m.gauge(names.PLANNER_OBSERVED_LOAD, "last interval: requests/s, mean input and "
                                "output tokens", ["series"])
        self.predicted = m.gauge(names.PLANNER_PREDICTED_LOAD, "what the pools are sized for", ["series"])
        self.error = m.gauge(names.PLANNER_PREDICTION_ERROR, "mean absolute percentage error of each "
                             "predictor's forecasts so far", ["series", "predictor"])
        self.correction = m.gauge(names.PLANNER_CORRECTION, "observed over the profile's time, per role", ["role"])
        self.margin = m.gauge(names.PLANNER_SLO_MARGIN, "(bound - predicted) / bound at the target", ["role"])
        self.within = m.gauge(names.PLANNER_OBSERVED_WITHIN_SLO, "last interval's share of requests within "
                              "each bound", ["slo"])
        self.decisions = m.counter(names.PLANNER_DECISIONS, "decisions per role and what they did",
                                   ["role", "action"])
        self.changed = m.counter(names.PLANNER_NODES_CHANGED, "nodes started or drained", ["role", "action"])
        self.scrape_failures = m.counter(names.PLANNER_SCRAPE_FAILURES, "routers whose /metrics could not be "
                                         "read, by reason (unauthorized: --protect-metrics and no cluster "
                                         "token; bad_status; unreachable)", ["reason"])
        self.routers_scraped = m.gauge(names.PLANNER_ROUTERS_SCRAPED, "routers whose /metrics the last scrape read")
        for reason in ScrapeFailure:
            self.scrape_failures.labels(reason=reason)
        for role in ROLES:
            for action in names.PLANNER_ACTIONS:
                self.decisions.labels(role=role, action=action)
            for action in ("started", "drained"):
                self.changed.labels(role=role, action=action)

    def record(self, d: PlanningDecision, errors: dict[str, dict[str, dict]]) -> None:
        for role in ROLES:
            self.target.labels(role=role).set(d.target[role])
            self.current.labels(role=role).set(d.current[role] + d.change.get(role, 0))
            self.correction.labels(role=role).set(d.correction[role])
            margin = d.sizing[role].slo_margin
            self.margin.labels(role=role).set(math.nan if margin is None else margin)
            n = d.change.get(role, 0)
            self.decisions.labels(role=role, action="up" if n > 0 else "down" if n < 0 else "hold").inc()
            if n:
                self.changed.labels(role=role, action="started" if n > 0 else "drained").inc(abs(n))
        for series in names.PLANNER_SERIES:
            obs, pred = d.observed.get(series), d.predicted.get(series)
            self.observed.labels(series=series).set(math.nan if obs is None else obs)
            self.predicted.labels(series=series).set(math.nan if pred is None else pred)
            for predictor, e in errors[series].items():
                mape = e["mape"]
                self.error.labels(series=series, predictor=predictor).set(math.nan if mape is None else mape)
        for slo, key in (("ttft", "ttft_within_slo"), ("itl", "itl_within_slo")):
            v = d.observed.get(key)
            self.within.labels(slo=slo).set(math.nan if v is None else v)


class Planner:
    def __init__(self, config: PlannerConfig, actuator: Actuator | None = None):
        self.config = config
        dep = config.deployment
        self.model = PoolModel(dep, config.slo)
        self.policy = Policy(self.model, config.policy, ahead=config.ahead, window=config.window,
                             time_scale=config.time_scale)
        self.observer = Observer(list(config.router_urls), config.redis_url, config.slo.ttft_s, config.slo.itl_s,
                                 config.time_scale, config.model, cluster_token=config.cluster_token)
        self.actuator: Actuator = actuator if actuator is not None else ExportOnly()
        self.decisions: deque[PlanningDecision] = deque(maxlen=config.history)
        self.metrics = PlannerMetrics(config.model or dep.prefill.model)
        self._lock = threading.Lock()  # /debug/planner may be read from another thread (up)

    async def observe(self) -> Observation | None:
        """The observer's interval (None: the first, or no router answered), its failed
        reads counted."""
        obs = await self.observer.observe()
        scrape = self.observer.last_scrape
        self.metrics.routers_scraped.set(scrape.answered)
        for reason in scrape.failed.values():
            self.metrics.scrape_failures.labels(reason=reason).inc()
        return obs

    async def step(self) -> PlanningDecision | None:
        """One interval: observe, decide, apply, record. None until two scrapes exist."""
        obs = await self.observe()
        if obs is None:
            return None
        nodes = self.observer.last_nodes
        current = self.actuator.counts(nodes)
        decision = self.policy.decide(obs, current)
        did = await self.actuator.apply(decision.change, nodes)
        if isinstance(self.actuator, ExportOnly):
            decision.reasons.append("targets exported (splitserve:planner_target_replicas); the autoscaler applies them")
        decision.reasons.extend(did)
        errors = self.policy.errors()
        with self._lock:
            self.decisions.append(decision)
        self.metrics.record(decision, errors)
        log.info("planner decision %s", msgspec.json.encode(decision).decode())
        return decision

    async def run(self, stop: asyncio.Event) -> None:
        """Decide every interval until ``stop``; a failing interval is logged, not fatal."""
        await self.observe()  # the baseline scrape
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), self.config.interval_s)
                    break
                except TimeoutError:
                    pass
                try:
                    await self.step()
                except Exception:  # one bad interval (a node mid-restart, a parse error) must not end planning
                    log.exception("planner: the interval failed; the next one tries again")
        finally:
            await self.observer.close()

    def debug(self, n: int = 20) -> dict:
        c = self.config
        with self._lock:
            last = [msgspec.to_builtins(d) for d in list(self.decisions)[-n:]]
        scrape = self.observer.last_scrape
        routers = {"answered": scrape.answered, "failed": {url: str(why) for url, why in scrape.failed.items()}}
        return {"profile": c.deployment.describe(), "slo": c.slo.describe(), "interval_s": c.interval_s,
                "routers": routers,
                "time_scale": c.time_scale, "bounds": _bounds(c), "actuator": self.actuator.state(),
                "prediction_errors": self.policy.errors(), "decisions": last}

    def app(self) -> web.Application:
        async def debug(request: web.Request) -> web.Response:
            try:
                n = max(1, min(1000, int(request.query.get("n", "20"))))
            except ValueError:
                return web.json_response({"error": {"message": "n: give a whole number", "param": "n"}}, status=400)
            return web.json_response(self.debug(n), dumps=lambda o: msgspec.json.encode(o).decode())

        async def metrics(request: web.Request) -> web.Response:
            body, ctype = self.metrics.m.render()
            return web.Response(body=body, headers={"Content-Type": ctype})

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "decisions": len(self.decisions)})

        app = web.Application()
        app.add_routes([web.get("/debug/planner", debug), web.get("/metrics", metrics), web.get("/health", health)])
        return app


def _bounds(c: PlannerConfig) -> dict[str, int]:
    b, p = c.policy.bounds, c.policy
    return {"min_prefill": b.min_prefill, "max_prefill": b.max_prefill, "min_decode": b.min_decode,
            "max_decode": b.max_decode, "prefill_dp": p.prefill_dp, "decode_dp": p.decode_dp}


async def serve(planner: Planner, stop: asyncio.Event, on_port=None) -> None:
    """Serve the planner's app on its config's address and plan until ``stop``."""
    runner = web.AppRunner(planner.app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, planner.config.host, planner.config.port)
        await site.start()
        port = runner.addresses[0][1]
        if on_port is not None:
            on_port(port)
        print(f"READY http://{planner.config.host}:{port} planner", flush=True)
        await planner.run(stop)
    finally:
        await runner.cleanup()


def run_planner(config: PlannerConfig) -> None:
    """``splitserve planner``: plan until SIGINT / SIGTERM (targets exported, or with
    nothing to start and stop, the same)."""
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(Planner(config), stop)

    asyncio.run(main())


class PlannerThread:
    """The planner on its own thread and event loop (``up --planner``): ``start()`` returns
    its HTTP port once it serves; ``stop()`` ends it."""

    def __init__(self, planner: Planner):
        self.planner = planner
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="planner", daemon=True)

    def _main(self) -> None:
        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await serve(self.planner, self._stop, self._serving)
        try:
            asyncio.run(main())
        finally:
            self._ready.set()

    def _serving(self, port: int) -> None:
        self.port = port
        self._ready.set()

    def start(self, timeout: float = 30.0) -> int:
        self._thread.start()
        if not self._ready.wait(timeout) or not self.port:
            raise RuntimeError("the planner did not start serving")
        return self.port

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)


def start_local_planner(args, cluster, model: str) -> PlannerThread:
    """``up --planner``: the planner of ``cluster`` (its routers, its Redis, its nodes to
    start and drain) on a thread, serving on ``.port``."""
    from .actuator import LocalPools
    from .config import planner_config

    config = planner_config(args, "planner-", dp={role: cluster.dp_size(role) for role in ROLES},
                            router_urls=tuple(cluster.urls), redis_url=cluster.redis_url, model=model,
                            cluster_token=cluster.cluster_token)
    dep = config.deployment
    pools = LocalPools(cluster, {"prefill": dep.prefill.node_gpus, "decode": dep.decode.node_gpus})
    thread = PlannerThread(Planner(config, pools))
    thread.start()
    return thread
