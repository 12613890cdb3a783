"""The aiohttp app every node process serves, whatever its role.

Owns, around a NodeRuntime (node/runtime.py) and the role's server object (a
``NodeServer``: prefill_node/server.py, decode_node/server.py):

- the app's lifespan: engine, then the role's server, then the engine thread;
  stopped in reverse;
- the guard of every route: the cluster token (common/auth.py) on everything but
  /health and /metrics (401 without it, 403 with a wrong one), and 503 with
  Retry-After on the role's new work while draining;
- the routes every node has: ``POST /abort``, ``GET /health``, ``/metrics``,
  ``/debug/state`` (the runtime's state and the role's); the role lists its own
  routes as data (``NodeServer.routes``);
- the process's life: bind, READY line, SIGTERM drains (stop taking work,
  deregister, let in-flight requests finish within ``drain_grace_s``, exit 0); a
  broken node (``NodeRuntime.fail``: a tensor-parallel rank died) deregisters and exits
  with ``EXIT_BROKEN`` at once, its in-flight work already failed by the role.

Must not know which role it serves: the role's module builds its app with
``build_node_app`` and the process's entry point (cli.py) picks the role.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from aiohttp import web

from ..common.auth import CLUSTER_TOKEN_HEADER, token_matches
from ..common.config import NodeConfig
from ..common.errors import InvalidRequest
from ..common.http import error_response, read_msgpack
from ..common.protocol import Abort
from ..engine.block_export import BlockExporter
from ..engine.engine_core import RequestDelta
from ..engine.engine_thread import AbortRequest
from ..engine.parallel.group import TPFailure
from .runtime import NodeRuntime

log = logging.getLogger(__name__)
T = TypeVar("T")
OPEN_PATHS = ("/health", "/metrics")  # no cluster token needed
DRAIN_POLL_S = 0.1
EXIT_BROKEN = 3  # the exit status of a node that failed (a rank died); its supervisor restarts it
FAILED_FLUSH_S = 0.5  # a failed node's last answers (errors, cut streams) leave before it exits


class NodeServer(Protocol):
    """What a role's server object (DecodeNode, PrefillNode) gives the shared app.
    Built with the app, before the engine; ``start`` runs once the engine is built."""
    @property
    def exporter(self) -> BlockExporter | None: ...  # how the engine thread packs prompt blocks

    @property
    def kv_addr(self) -> str: ...  # where it receives KV blocks ("" if it does not), once started

    def routes(self) -> list[web.RouteDef]: ...  # its own routes; its POSTs are new work
    def on_deltas(self, deltas: list[RequestDelta]) -> None: ...
    def end_stream(self, request_id: str) -> bool: ...  # POST /abort, once the engine let go
    def inflight(self) -> int: ...
    def debug_state(self) -> dict: ...  # its part of GET /debug/state
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


RUNTIME = web.AppKey("node_runtime", NodeRuntime)
NODE = web.AppKey("node", NodeServer)  # the role's server object


def build_node_app(runtime: NodeRuntime, node: NodeServer, shm: bool) -> web.Application:
    """The aiohttp app of a node: ``runtime`` and ``node`` (built on it) start in the
    app's lifespan; with ``shm`` the KV cache lives in /dev/shm. Routes: the node's own
    (``node.routes()``) and every node's."""
    config = runtime.config
    own = node.routes()
    new_work = {r.path for r in own if r.method == "POST"}  # refused while draining; /abort still works

    @web.middleware
    async def guard(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            presented = request.headers.get(CLUSTER_TOKEN_HEADER)
            if config.cluster_token is not None and not token_matches(presented, config.cluster_token):
                status = 401 if presented is None else 403
                return error_response(status, f"{request.path} is internal: send this cluster's token "
                                      f"in {CLUSTER_TOKEN_HEADER}")
        if request.path in new_work and runtime.draining:
            resp = error_response(503, "this node is draining (shutting down); use another node")
            resp.headers["Retry-After"] = "1"
            return resp
        return await handler(request)

    app = web.Application(client_max_size=64 << 20, middlewares=[guard])  # prompts of a long context fit
    app[RUNTIME], app[NODE] = runtime, node

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        try:
            await runtime.start_engine(shm)
            await node.start()
            runtime.start_loop(node.on_deltas, node.exporter, node.kv_addr)
        except BaseException:
            runtime.shutdown()  # its /dev/shm segment, if it made one
            raise
        yield
        await runtime.stop_heartbeat()
        await node.stop()
        runtime.shutdown()

    app.cleanup_ctx.append(lifespan)
    app.add_routes([*own, *node_routes()])
    return app


def node_routes() -> Sequence[web.RouteDef]:
    """The routes of every node, whatever its role."""
    return [web.post("/abort", abort), web.get("/health", health), web.get("/metrics", metrics),
            web.get("/debug/state", debug_state)]


async def abort(request: web.Request) -> web.Response:
    """POST /abort (Abort): the engine drops the request and frees its blocks, then the
    node ends its stream or transfer. Idempotent; says whether anything was running."""
    try:
        msg = await read_msgpack(request, Abort)
    except InvalidRequest as e:
        return error_response(400, str(e), e.field)
    try:
        found = await request.app[RUNTIME].engine_thread.submit(AbortRequest(msg.request_id))
    except TPFailure:  # a rank died: the engine stopped for good and holds nothing any more
        found = False
    ended = request.app[NODE].end_stream(msg.request_id)
    return web.json_response({"aborted": bool(found or ended)})


async def health(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    return web.json_response({"status": "ok", "role": rt.config.role, "node_id": rt.node_id})


async def metrics(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    rt.refresh_metrics()
    body, content_type = rt.metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def debug_state(request: web.Request) -> web.Response:
    return web.json_response({**request.app[RUNTIME].state(), **request.app[NODE].debug_state()})


async def start_site(app: web.Application, config: NodeConfig) -> web.AppRunner:
    """Start a node app: run its lifespan (engine), bind (port 0 picks one), then tell
    the runtime its port (it registers). ``runner.cleanup()`` stops it again."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)  # a gone client cancels its handler
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        await app[RUNTIME].listening(runner.addresses[0][1])
    except BaseException:
        await runner.cleanup()
        raise
    return runner


async def serve(app: web.Application, config: NodeConfig, stop: asyncio.Event) -> int:
    """Run a node app until ``stop`` is set, then drain (exit status 0), or until the node
    fails (``EXIT_BROKEN``: it deregisters and stops at once); prints ``READY <http_addr>
    <node_id>`` for launchers."""
    rt = app[RUNTIME]
    runner = await start_site(app, config)
    try:
        print(f"READY {rt.http_addr} {rt.node_id}", flush=True)
        ended = [asyncio.create_task(stop.wait()), asyncio.create_task(rt.failed.wait())]
        try:
            await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in ended:
                task.cancel()
        if rt.failure is None:
            await drain(app, config.drain_grace_s)
        else:
            await rt.stop_heartbeat()  # routers stop choosing it now, not after its record's TTL
            await asyncio.sleep(FAILED_FLUSH_S)
    finally:
        await runner.cleanup()
    if rt.failure is not None:
        log.error("node %s exits with status %d: %s", rt.node_id, EXIT_BROKEN, rt.failure)
        return EXIT_BROKEN
    return 0


async def drain(app: web.Application, grace_s: float) -> None:
    """Stop taking new work (503), deregister so routers stop choosing this node, and
    wait up to ``grace_s`` for in-flight requests; what is left is cancelled by the
    cleanup that follows (its blocks freed like any aborted request's)."""
    rt, node = app[RUNTIME], app[NODE]
    await rt.start_draining()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while node.inflight() and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    left = node.inflight()
    log.warning("node %s drained%s", rt.node_id, f"; cancelling {left} requests past the grace period" if left else "")


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """``asyncio.run(main(stop))`` where SIGINT / SIGTERM set ``stop``; its result."""
    async def runner() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await main(stop)

    return asyncio.run(runner())


def run_node(build_app: Callable[[NodeConfig], web.Application], config: NodeConfig) -> int:
    """Serve ``build_app(config)`` (the role's app) until SIGINT / SIGTERM, then drain; the
    process's exit status (``EXIT_BROKEN`` when the node failed)."""
    return run_until_signal(lambda stop: serve(build_app(config), config, stop))
