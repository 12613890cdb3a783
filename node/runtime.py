"""NodeRuntime: the parts every node process shares.

- the engine (its KV cache in shared memory when the shm transport needs it)
  and the EngineThread that runs it;
- the node's identity (node id, epoch) and its registry heartbeat with load;
- the publisher of its prefix-cache events to the Redis index (node/kv_publisher.py),
  fed from the engine thread, under the same node id and epoch;
- a per-node Prometheus registry and the routes GET /health, /metrics,
  /debug/state (JSON: device, dtype, KV pool size, load, transfers);
- the guard of every route: the cluster token (common/auth.py) on everything but
  /health and /metrics (401 without it, 403 with a wrong one), and 503 with
  Retry-After on new work while draining;
- the process's life: /dev/shm KV segments of dead owners removed on start
  (node/shm_segments.py), its own on exit; SIGTERM drains (stop taking work,
  deregister, let in-flight requests finish within ``drain_grace_s``, exit 0).

Holds the engine only between building it and handing it to the EngineThread: from
then on the engine thread owns it, and the event loop knows it through what was
fixed at build time (``limits``, ``kv_caches``, ``layout``, ``pool``) and the
EngineThread's messages and published ``stats`` (engine/engine_thread.py).
"""

import asyncio
import logging
import os
import signal
from typing import Awaitable, Callable, NamedTuple, Protocol

import msgspec
import torch
from aiohttp import web

from ..common.auth import CLUSTER_TOKEN_HEADER, token_matches
from ..common.config import NodeConfig
from ..common.errors import InvalidRequest
from ..common.http import error_response, read_msgpack
from ..common.kv_events import KVEvent
from ..common.kv_index import KVIndex
from ..common.protocol import Abort
from ..common.registry import Heartbeat, NodeInfo, NodeRegistry, new_epoch
from ..engine.engine_core import EngineCore, RequestDelta
from ..engine.engine_thread import AbortRequest, BlockExporter, EngineThread
from ..engine.limits import RequestLimits
from ..kvtransfer.block_store import allocate_kv_cache, free_shared_kv_cache
from ..kvtransfer.layout import KVLayout
from .kv_publisher import KVEventPublisher
from .metrics import NodeMetrics
from .shm_segments import remove_dead_segments, segment_name

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/metrics")  # no cluster token needed
DRAIN_POLL_S = 0.1


class NodeServer(Protocol):
    """What a role's server object (DecodeNode, PrefillNode) gives the runtime."""
    @property
    def exporter(self) -> BlockExporter | None: ...  # how the engine thread packs prompt blocks

    def on_deltas(self, deltas: list[RequestDelta]) -> None: ...
    def end_stream(self, request_id: str) -> bool: ...  # POST /abort, once the engine let go
    def inflight(self) -> int: ...
    def debug_state(self) -> dict: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


class RedisLink(NamedTuple):
    """The node's presence in Redis: its registry record and its prefix-index stream."""
    registry: NodeRegistry
    heartbeat: Heartbeat
    kv_index: KVIndex
    publisher: KVEventPublisher


class NodeRuntime:
    # Set by start_engine / loop_start, which the app's lifespan runs before any request:
    limits: RequestLimits
    kv_caches: torch.Tensor  # the engine's KV tensor: transfers read/write the blocks they were given
    layout: KVLayout
    pool: dict  # where the KV pool lives and how big it is (/debug/state, metrics)
    engine_thread: EngineThread  # the only way to the engine once started

    def __init__(self, config: NodeConfig):
        self.config = config
        self.epoch = new_epoch()
        self.node_id = config.node_id
        self._engine: EngineCore | None = None  # built, not yet handed to the EngineThread
        self.shm_name: str | None = None
        self.kv_addr = ""
        self.http_addr = ""
        self.metrics = NodeMetrics(config.engine.model_id, config.role)
        self.debug_extra: Callable[[], dict] = dict
        self.draining = False  # SIGTERM received: new work is refused with 503
        self._heartbeat_stopped = False
        self.redis: RedisLink | None = None  # None: no --redis-url, the node is not discoverable

    async def start_engine(self, shm: bool) -> None:
        """Load the model off the event loop (seconds); with ``shm`` the KV cache lives in
        /dev/shm so a same-host prefill node can write blocks straight into it."""
        factory = None
        removed = remove_dead_segments()
        if removed:
            log.info("removed %d /dev/shm KV segments of dead processes: %s", len(removed), ", ".join(removed))
        if shm:
            self.shm_name = segment_name(os.getpid())
            factory = lambda shape, dtype: allocate_kv_cache(KVLayout.of_cache(shape, dtype), shape[2],
                                                             self.shm_name)
        engine = self._engine = await asyncio.to_thread(EngineCore, self.config.engine, factory)
        kv, cfg = engine.runner.kv_caches, self.config.engine
        self.limits, self.kv_caches = engine.limits, kv
        self.layout = KVLayout.of_cache(kv.shape, kv.dtype)
        blocks = engine.num_blocks  # the tensor may hold one more: static decode's scratch block
        block_bytes = kv.numel() * kv.element_size() // kv.shape[2]
        self.pool = {"device": str(kv.device), "dtype": str(kv.dtype).removeprefix("torch."), "blocks": blocks,
                     "bytes": blocks * block_bytes, "tokens": blocks * cfg.block_size,
                     "gpu_memory_utilization": cfg.gpu_memory_utilization}
        self.metrics.set_pool(self.pool)

    def loop_start(self, on_deltas: Callable[[list[RequestDelta]], None],
                   exporter: BlockExporter | None = None) -> None:
        def deliver(deltas: list[RequestDelta]) -> None:
            on_deltas(deltas)
            if self.redis is not None and any(d.finish_reason for d in deltas):
                self.redis.heartbeat.nudge()  # load dropped: tell the routers now, not in ~1.7 s
        assert self._engine is not None, "start_engine first"
        self.engine_thread = EngineThread(self._engine, asyncio.get_running_loop(), deliver, self._on_kv_events,
                                          exporter, step_observer=self.metrics.observe_step)
        self._engine = None  # the engine thread's from here on
        self.engine_thread.start()

    def _on_kv_events(self, events: list[KVEvent], snapshot: list[int] | None) -> None:
        # Before the publisher starts the events are dropped: its first write is a snapshot.
        if self.redis is not None:
            self.redis.publisher.on_kv(events, snapshot)

    def info(self) -> NodeInfo:
        return NodeInfo(node_id=self.node_id, role=self.config.role, http_addr=self.http_addr,
                        model=self.config.engine.model_id, epoch=self.epoch, kv_backend=self.config.kv_backend,
                        kv_addr=self.kv_addr, capacity_tokens=self.limits.kv_capacity_tokens,
                        block_size=self.config.engine.block_size, max_model_len=self.limits.max_model_len,
                        load=self.engine_thread.load)

    async def start_heartbeat(self) -> None:
        """Register the node and publish its prefix-cache index (both need the final node id)."""
        if self.config.redis_url:
            index = KVIndex(self.config.redis_url)
            publisher = KVEventPublisher(index, self.node_id, self.epoch, self.engine_thread.request_kv_snapshot,
                                         self.metrics.index_batches)
            registry = NodeRegistry(self.config.redis_url)
            self.redis = RedisLink(registry, Heartbeat(registry, self.info), index, publisher)
            publisher.start()
            self.redis.heartbeat.start()

    async def stop_heartbeat(self) -> None:
        """Deregister and stop publishing (idempotent: drain calls it, then the lifespan)."""
        if self._heartbeat_stopped:
            return
        self._heartbeat_stopped = True
        if self.redis is not None:
            await self.redis.heartbeat.stop()
            await self.redis.registry.close()
            await self.redis.publisher.stop()
            await self.redis.kv_index.close()

    def shutdown(self) -> None:
        if hasattr(self, "engine_thread"):
            self.engine_thread.stop()
        if self.shm_name:
            free_shared_kv_cache(self.shm_name)

    def state(self) -> dict:
        st = self.engine_thread.stats
        pub = None if self.redis is None else self.redis.publisher
        index = None if pub is None else {"seq": pub.seq, "in_sync": pub.in_sync, "snapshots": pub.snapshots}
        return {"node_id": self.node_id, "role": self.config.role, "epoch": self.epoch, "pid": os.getpid(),
                "shm_name": self.shm_name, "kv_addr": self.kv_addr, "draining": self.draining, "kv_index": index,
                "device": self.config.engine.device, "dtype": self.config.engine.dtype, "kv_pool": self.pool,
                "kv_blocks_total": st.kv_blocks_total, "kv_blocks_free": st.kv_blocks_free,
                "load": msgspec.structs.asdict(st.load), "steps": st.steps, "busy_s": st.busy_s,
                "computed_tokens": st.computed_tokens, "preemptions": st.preemptions, **self.debug_extra()}


RUNTIME = web.AppKey("node_runtime", NodeRuntime)
NODE = web.AppKey("node", NodeServer)  # the role's server object


def build_node_app(config: NodeConfig, node_cls: Callable[[NodeConfig, NodeRuntime], NodeServer], shm: bool,
                   posts: dict[str, str]) -> web.Application:
    """The aiohttp app of a node: the runtime and ``node_cls(config, runtime)`` (a
    NodeServer) live in the app's lifespan; ``posts`` maps POST paths to the node's
    handler method names."""
    new_work = set(posts)  # refused while draining; /abort still works

    @web.middleware
    async def guard(request: web.Request, handler):
        if request.path not in OPEN_PATHS:
            presented = request.headers.get(CLUSTER_TOKEN_HEADER)
            if config.cluster_token is not None and not token_matches(presented, config.cluster_token):
                status = 401 if presented is None else 403
                return error_response(status, f"{request.path} is internal: send this cluster's token "
                                      f"in {CLUSTER_TOKEN_HEADER}")
        if request.path in new_work and RUNTIME in request.app and request.app[RUNTIME].draining:
            resp = error_response(503, "this node is draining (shutting down); use another node")
            resp.headers["Retry-After"] = "1"
            return resp
        return await handler(request)

    app = web.Application(client_max_size=64 << 20, middlewares=[guard])  # prompts of a long context fit

    async def lifespan(app):
        rt = NodeRuntime(config)
        await rt.start_engine(shm)
        node = node_cls(config, rt)
        rt.loop_start(node.on_deltas, node.exporter)
        await node.start()
        rt.debug_extra = node.debug_state
        app[RUNTIME], app[NODE] = rt, node
        yield
        await rt.stop_heartbeat()
        await node.stop()
        rt.shutdown()

    app.cleanup_ctx.append(lifespan)
    for path, method in posts.items():
        app.router.add_post(path, _node_handler(method))
    app.router.add_post("/abort", abort)
    add_common_routes(app)
    return app


async def abort(request: web.Request) -> web.Response:
    """POST /abort (Abort): the engine drops the request and frees its blocks, then the
    node ends its stream or transfer. Idempotent; says whether anything was running."""
    try:
        msg = await read_msgpack(request, Abort)
    except InvalidRequest as e:
        return error_response(400, str(e), e.field)
    found = await request.app[RUNTIME].engine_thread.submit(AbortRequest(msg.request_id))
    ended = request.app[NODE].end_stream(msg.request_id)
    return web.json_response({"aborted": bool(found or ended)})


def _node_handler(method: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        return await getattr(request.app[NODE], method)(request)
    return handler


def add_common_routes(app: web.Application) -> None:
    """GET /health, /metrics and /debug/state of the node in ``app[RUNTIME]``."""
    async def health(request):
        rt = request.app[RUNTIME]
        return web.json_response({"status": "ok", "role": rt.config.role, "node_id": rt.node_id})

    async def metrics(request):
        rt = request.app[RUNTIME]
        rt.metrics.set_load(rt.engine_thread.load, rt.engine_thread.stats.preemptions,
                            rt.redis.heartbeat.failures if rt.redis is not None else 0)
        body, content_type = rt.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def debug_state(request):
        return web.json_response(request.app[RUNTIME].state())

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/state", debug_state)


async def start_site(app: web.Application, config: NodeConfig) -> web.AppRunner:
    """Start a node app: run its lifespan (engine), bind (port 0 picks one), learn the
    real address and start the heartbeat. ``runner.cleanup()`` stops it again."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)  # a gone client cancels its handler
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        port = runner.addresses[0][1]
        rt: NodeRuntime = app[RUNTIME]
        rt.http_addr = f"http://{config.host}:{port}"
        rt.node_id = config.node_id or f"{config.role}-{config.host}-{port}"
        await rt.start_heartbeat()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def build_app(config: NodeConfig) -> web.Application:
    """The app of a prefill, decode or colocated node."""
    if config.role == "prefill":
        from ..prefill_node.server import build_app as build
    else:
        from ..decode_node.server import build_app as build
    return build(config)


async def serve(app: web.Application, config: NodeConfig, stop: asyncio.Event) -> None:
    """Run a node app until ``stop`` is set, then drain; prints ``READY <http_addr> <node_id>``
    for launchers."""
    runner = await start_site(app, config)
    try:
        print(f"READY {app[RUNTIME].http_addr} {app[RUNTIME].node_id}", flush=True)
        await stop.wait()
        await drain(app, config.drain_grace_s)
    finally:
        await runner.cleanup()


async def drain(app: web.Application, grace_s: float) -> None:
    """Stop taking new work (503), deregister so routers stop choosing this node, and
    wait up to ``grace_s`` for in-flight requests; what is left is cancelled by the
    cleanup that follows (its blocks freed like any aborted request's)."""
    rt, node = app[RUNTIME], app[NODE]
    rt.draining = True
    await rt.stop_heartbeat()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while node.inflight() and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    left = node.inflight()
    log.warning("node %s drained%s", rt.node_id, f"; cancelling {left} requests past the grace period" if left else "")


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """``asyncio.run(main(stop))`` where SIGINT / SIGTERM set ``stop``."""
    async def runner():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())


def run_node(config: NodeConfig) -> None:
    """Start a prefill, decode or colocated node and serve until SIGINT / SIGTERM."""
    run_until_signal(lambda stop: serve(build_app(config), config, stop))
