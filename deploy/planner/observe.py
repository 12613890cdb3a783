"""What the planner sees each interval: the routers' Prometheus metrics (summed over every
router, differenced against the last scrape) and the node registry's records (live nodes
per role and their heartbeat load).

    from the routers (/metrics, common/metric_names.py)
      rate      routing decisions to decode nodes / interval: requests arriving
      isl       prompt tokens routed / those decisions
      osl       request_generation_tokens histogram: mean output tokens of finished requests
      TTFT      time_to_first_token histogram: mean, and the share at or under the SLO
      ITL       request_time_per_output_token histogram (a request's mean ITL): the same
      in flight router_requests_running
    from Redis (common/node_registry.py)
      per role: nodes, running, waiting, queued prefill tokens, mean KV usage

The routers' /metrics are read with the cluster token (what --protect-metrics accepts
besides an API key). A router that cannot be read (401 / 403 without the token, another
status, no answer) is logged by name and reason and kept in ``last_scrape``, which the
planner counts (planner_scrape_failures_total) and shows: an interval is never planned on
silently missing routers, and with none answering there is no observation at all.

A share at or under a bound is read from the cumulative buckets, linear within the
bucket that holds the bound. A counter that went down (a router restarted) counts from
zero. With ``time_scale`` (a simulated cluster sped up k times) rates are divided and
latencies multiplied by k, so everything is in the profile's time.

Owns scraping and differencing; must not decide anything.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import NamedTuple
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ...common import metric_names as names
from ...common.auth import auth_headers
from ...common.outcomes import ScrapeFailure
from ...common.node_registry import REDIS_ERRORS, NodeInfo, NodeRegistry

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")


class Hist(NamedTuple):
    """A cumulative histogram: ((upper bound, observations at or under it), ...), sum, n."""
    buckets: tuple[tuple[float, float], ...]
    sum: float
    n: float  # observations

    def minus(self, old: "Hist") -> "Hist":
        if self.n < old.n or len(old.buckets) != len(self.buckets):
            return self  # reset (or first scrape): everything since the start
        return Hist(tuple((le, c - o) for (le, c), (_, o) in zip(self.buckets, old.buckets)),
                    self.sum - old.sum, self.n - old.n)

    def share_at_most(self, bound: float) -> float | None:
        """Share of observations <= ``bound`` (None: no observation)."""
        if self.n <= 0:
            return None
        prev_le, prev_c = 0.0, 0.0
        for le, c in self.buckets:
            if bound <= le:
                if math.isinf(le):
                    return prev_c / self.n
                return (prev_c + (c - prev_c) * (bound - prev_le) / (le - prev_le)) / self.n
            prev_le, prev_c = le, c
        return 1.0

    def mean(self) -> float | None:
        return self.sum / self.n if self.n > 0 else None


EMPTY = Hist((), 0.0, 0.0)


class RouterTotals(NamedTuple):
    """Counters and histograms summed over every router, at one scrape."""
    routed: float
    prompt_tokens: float
    failures: float
    running: float
    ttft: Hist
    itl: Hist  # per request: its mean inter-token latency
    output_tokens: Hist
    routers: int  # answered the scrape


class Scrape(NamedTuple):
    """One scrape of every router: how many answered, and why the others did not."""
    answered: int
    failed: dict[str, ScrapeFailure]  # router address -> why


class PoolState(NamedTuple):
    nodes: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    kv_usage: float  # mean over the role's nodes
    running_by_node: tuple[int, ...] = ()  # each node's running requests (how evenly they spread)
    generated_tokens: int = 0  # output tokens the running requests have produced so far


class Observation(NamedTuple):
    """One interval, in the profile's time (seconds, requests/s)."""
    at: float  # monotonic wall time of the scrape
    interval_s: float
    rate: float
    isl: float | None  # None: nothing routed
    osl: float | None  # None: nothing finished
    ttft_mean: float | None
    ttft_ok: float | None  # share of first tokens within the SLO's TTFT
    itl_mean: float | None
    itl_ok: float | None
    finished: int
    failures: float
    in_flight: float
    pools: dict[str, PoolState]  # role -> state
    routers: int
    ttft_n: int = 0  # first tokens behind ttft_mean / ttft_ok
    itl_n: int = 0  # finished requests behind itl_mean / itl_ok


def parse_router_metrics(text: str) -> RouterTotals:
    routed = prompt = failures = running = 0.0
    hists: dict[str, Hist] = {}
    wanted = {names.TIME_TO_FIRST_TOKEN: "ttft", names.TIME_PER_OUTPUT_TOKEN: "itl",
              names.REQUEST_GENERATION_TOKENS: "output_tokens"}
    for fam in text_string_to_metric_families(text):
        full = fam.name + ("_total" if fam.type == "counter" else "")
        if full == names.ROUTING_DECISIONS:
            routed += sum(s.value for s in fam.samples if s.name.endswith("_total") and s.labels.get("role") == "decode")
        elif full == names.PROMPT_TOKENS:
            prompt += sum(s.value for s in fam.samples if s.name.endswith("_total"))
        elif full == names.REQUEST_FAILURES:
            failures += sum(s.value for s in fam.samples if s.name.endswith("_total"))
        elif fam.name == names.ROUTER_RUNNING:
            running += sum(s.value for s in fam.samples)
        elif fam.name in wanted:
            buckets: dict[float, float] = {}
            total = count = 0.0
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
                elif s.name.endswith("_sum"):
                    total += s.value
                elif s.name.endswith("_count"):
                    count += s.value
            hists[wanted[fam.name]] = Hist(tuple(sorted(buckets.items())), total, count)
    return RouterTotals(routed, prompt, failures, running, hists.get("ttft", EMPTY), hists.get("itl", EMPTY),
                        hists.get("output_tokens", EMPTY), 1)


def add_totals(a: RouterTotals, b: RouterTotals) -> RouterTotals:
    def add(x: Hist, y: Hist) -> Hist:
        if not x.buckets:
            return y
        if not y.buckets:
            return x
        return Hist(tuple((le, c + d) for (le, c), (_, d) in zip(x.buckets, y.buckets)), x.sum + y.sum,
                    x.n + y.n)
    return RouterTotals(a.routed + b.routed, a.prompt_tokens + b.prompt_tokens, a.failures + b.failures,
                        a.running + b.running, add(a.ttft, b.ttft), add(a.itl, b.itl),
                        add(a.output_tokens, b.output_tokens), a.routers + b.routers)


def pool_states(nodes: list[NodeInfo], model: str | None = None) -> dict[str, PoolState]:
    out = {}
    for role in ROLES:
        mine = [n for n in nodes if n.role == role and (model is None or n.model == model)]
        out[role] = PoolState(len(mine), sum(n.load.running for n in mine), sum(n.load.waiting for n in mine),
                              sum(n.load.queued_prefill_tokens for n in mine),
                              sum(n.load.kv_usage for n in mine) / len(mine) if mine else 0.0,
                              tuple(n.load.running for n in mine), sum(n.load.generated_tokens for n in mine))
    return out


class Observer:
    """Scrapes ``router_urls`` (each host resolved to all its addresses: a headless
    Service names every router pod) and the node registry at ``redis_url``; ``observe()``
    returns the interval since the previous call (None on the first)."""

    def __init__(self, router_urls: list[str], redis_url: str | None, ttft_s: float, itl_s: float,
                 time_scale: float = 1.0, model: str | None = None, timeout_s: float = 5.0,
                 cluster_token: str | None = None):
        self.router_urls, self.redis_url, self.model = list(router_urls), redis_url, model
        self._headers = auth_headers(cluster_token)  # what a router's protected /metrics accepts
        self.ttft_s, self.itl_s, self.k = ttft_s, itl_s, time_scale
        self.timeout_s = timeout_s
        self._last: tuple[float, RouterTotals] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._registry: NodeRegistry | None = None
        self.last_nodes: list[NodeInfo] = []  # the node registry at the last observe()
        self.last_scrape = Scrape(0, {})  # the routers at the last scrape()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._registry is not None:
            await self._registry.close()

    async def nodes(self) -> list[NodeInfo]:
        """Every live node of the node registry (empty when Redis is unreachable: logged)."""
        if self.redis_url is None:
            return []
        if self._registry is None:
            self._registry = NodeRegistry(self.redis_url)
        try:
            return await self._registry.list_nodes()
        except REDIS_ERRORS as e:
            log.warning("planner: cannot read the node registry: %r", e)
            return []

    async def _endpoints(self) -> list[str]:
        loop = asyncio.get_running_loop()
        out = []
        for url in self.router_urls:
            parts = urlsplit(url)
            hostname = parts.hostname or "127.0.0.1"
            try:
                infos = await loop.getaddrinfo(hostname, parts.port or 80, type=0, proto=6)
            except OSError:
                infos = []
            addrs = sorted({str(i[4][0]) for i in infos}) or [hostname]
            for a in addrs:
                host = f"[{a}]" if ":" in str(a) else str(a)
                out.append(urlunsplit((parts.scheme, f"{host}:{parts.port or 80}", "", "", "")))
        return out

    async def scrape(self) -> RouterTotals | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        session = self._session

        failed: dict[str, ScrapeFailure] = {}

        async def one(url: str) -> RouterTotals | None:
            try:
                async with session.get(f"{url}/metrics", headers=self._headers) as r:
                    if r.status == 200:
                        return parse_router_metrics(await r.text())
                    failed[url] = ScrapeFailure.UNAUTHORIZED if r.status in (401, 403) else ScrapeFailure.BAD_STATUS
                    hint = (" (--protect-metrics: give the planner the cluster token, --cluster-token-file or "
                            "$SPLITSERVE_CLUSTER_TOKEN)" if failed[url] is ScrapeFailure.UNAUTHORIZED else "")
                    log.warning("planner: router %s answered %d to /metrics%s; planning without it",
                                url, r.status, hint)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                failed[url] = ScrapeFailure.UNREACHABLE
                log.warning("planner: cannot scrape router %s: %s: %s; planning without it", url,
                            type(e).__name__, e)
            return None
        got = [t for t in await asyncio.gather(*(one(u) for u in await self._endpoints())) if t is not None]
        self.last_scrape = Scrape(len(got), failed)
        if not got:
            log.warning("planner: no router's /metrics could be read: no observation, no decision")
            return None
        total = got[0]
        for t in got[1:]:
            total = add_totals(total, t)
        return total

    async def observe(self) -> Observation | None:
        now = time.monotonic()
        totals, nodes = await asyncio.gather(self.scrape(), self.nodes())
        self.last_nodes = nodes
        if totals is None:
            return None
        last, self._last = self._last, (now, totals)
        if last is None or now <= last[0]:
            return None
        prev = last[1]
        dt = (now - last[0]) * self.k  # profile seconds
        d = lambda new, old: new - old if new >= old else new  # noqa: E731 (a counter that reset counts from 0)
        routed = d(totals.routed, prev.routed)
        prompt = d(totals.prompt_tokens, prev.prompt_tokens)
        ttft, itl = totals.ttft.minus(prev.ttft), totals.itl.minus(prev.itl)
        out = totals.output_tokens.minus(prev.output_tokens)
        scale = lambda v: None if v is None else v * self.k  # noqa: E731
        return Observation(
            at=now, interval_s=dt, rate=routed / dt, isl=prompt / routed if routed else None,
            osl=out.mean(), ttft_mean=scale(ttft.mean()), ttft_ok=ttft.share_at_most(self.ttft_s / self.k),
            itl_mean=scale(itl.mean()), itl_ok=itl.share_at_most(self.itl_s / self.k),
            finished=int(out.n), failures=d(totals.failures, prev.failures), in_flight=totals.running,
            pools=pool_states(nodes, self.model), routers=totals.routers, ttft_n=int(ttft.n), itl_n=int(itl.n))
