"""The router's aiohttp application: routes, error middleware, request ids and the
lifespan that owns its clients.

    build_app(config)            -> web.Application (loads the tokenizer; no I/O yet)
    await start_router(config)   -> RunningRouter (serving; port 0 picks a free port)
    run_router(config)           blocks serving until SIGINT / SIGTERM (the CLI); the
                                 first signal drains (new requests 503, in-flight ones
                                 finish within --drain-grace), a second stops at once

Middlewares, outermost first: errors (OpenAI bodies, request ids, the request
counter) -> API key (auth.py, 401) -> admission (admission.py: 429 over
--max-inflight, 503 while draining). Below them, the listener (listener.py) caps
open connections and aiohttp's keep-alive timer doubles as the header timeout.

The routing policy is built once, with the app (its tie rotation and recent work
live as long as the app). The lifespan (cleanup_ctx) creates, in order, the Redis
`NodeRegistry`, the node discovery task, the Redis `KVIndex`, the `PrefixMirror` and
its follower task, the event-loop lag watch (loop_lag.py), the pooled
`aiohttp.ClientSession` to the nodes, the sharing of the policy's recent work with
the other router replicas (shared_work.py, when the policy keeps any), the
dispatcher and the Redis store of /v1/responses (responses/store.py: a Redis of its
own with --responses-redis-url, and its budgets), and closes them in reverse after waiting for pending aborts.

Must not import torch or `splitserve.engine`, or touch tensors.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple

import aiohttp
from aiohttp import web

from ..common.auth import redact_url
from ..common.errors import InvalidRequest
from ..common.http import peer_connector
from ..common.kv_index import KVIndex
from ..common.node_registry import NodeRegistry
from .http import completions, endpoints, extra_endpoints, responses
from .http.admission import Admission
from .http.auth import api_key_middleware
from .streams.background import BackgroundTasks
from .config import RouterConfig
from .routing.decisions import DecisionLog
from .routing.discovery import NodeDirectory
from .streams.dispatch import Dispatcher
from .errors import ApiError
from .http.listener import HEADER_TIMERS, header_timer_middleware, listen, raise_file_limit
from .loop_lag import watch_loop_lag
from .http.compile_budget import REJECTION_REASON, CompileBudget
from .metrics import RouterMetrics
from .streams.node_client import NodeClient
from .routing.policy_registry import make_policy
from .routing.mirror_follower import MirrorFollower
from .routing.prefix_mirror import PrefixMirror
from .responses.store import ResponseStore
from .routing.shared_work import SharedWork
from .http.state import (ADMISSION, COMPILE_BUDGET, CONFIG, DECISIONS, METRICS, POLICY, REQUEST_ID, SERVICES,
                    TOKENIZER, RouterServices)
from .tokenizer import RouterTokenizer

log = logging.getLogger(__name__)

MAX_REQUEST_ID_LEN = 128
ABORT_DRAIN_S = 5.0  # shutdown waits this long for pending aborts to reach the nodes
SHUTDOWN_STEP_S = 5.0  # the longest one other shutdown step (a Redis client closing) may take
# After the drain, handlers still running get this long before they are cancelled.
HANDLER_SHUTDOWN_S = 1.0
# After an answer that left the body unread (401, 413, 415, 429, 408), aiohttp reads and
# drops the rest for up to this long before closing, so the client sees the answer
# rather than a reset; short, since a slow client could hold the socket meanwhile.
LINGER_S = 2.0


def build_app(config: RouterConfig) -> web.Application:
    """The router app for ``config``. Raises ValueError naming the setting when the
    model folder is unusable."""
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[header_timer_middleware, _error_middleware,
                                       api_key_middleware, _admission_middleware])
    app[CONFIG] = config
    app[HEADER_TIMERS] = {}
    app[TOKENIZER] = RouterTokenizer(config.resolved_model_dir, config.max_model_len,
                                     config.allow_long_max_model_len)
    app[METRICS] = RouterMetrics.create(config.model_id)
    app[DECISIONS] = DecisionLog(app[METRICS])
    app[ADMISSION] = Admission(config.max_inflight, config.retry_after_s, app[METRICS])
    rejected = app[METRICS].admission_rejections.labels(reason=REJECTION_REASON)
    app[COMPILE_BUDGET] = CompileBudget(config.schema_compiles_per_key, config.schema_compiles_per_key_per_minute,
                                        on_reject=rejected.inc)
    app[POLICY] = make_policy(config.policy, config.weights)
    app.cleanup_ctx.append(_services)
    app.on_response_prepare.append(_add_request_id)
    app.router.add_post("/v1/completions", completions.completions)
    app.router.add_post("/v1/chat/completions", completions.chat_completions)
    responses.register(app)  # OpenAI's Responses API: /v1/responses[/{id}]
    app.router.add_get("/v1/models", endpoints.list_models)
    app.router.add_get("/v1/models/{model}", endpoints.get_model)
    app.router.add_get("/health", endpoints.health)
    app.router.add_get("/metrics", endpoints.metrics)
    app.router.add_get("/debug/decisions", endpoints.decisions)
    extra_endpoints.register(app)  # vLLM's /tokenize, /detokenize, /version, /ping
    return app


async def _services(app: web.Application) -> AsyncIterator[None]:
    config, metrics = app[CONFIG], app[METRICS]
    registry = NodeRegistry(config.redis_url)
    directory = NodeDirectory(registry, config.model_id, metrics, config.poll_interval_s,
                              block_size=config.block_size)
    await directory.refresh()  # know the nodes before the first request (Redis may be down)
    if (mismatch := directory.model_mismatch()) is not None:
        await registry.close()
        raise ValueError(mismatch)  # the CLI prints it and exits 2
    directory.start()
    index = KVIndex(config.redis_url, timeout_s=config.index_timeout_s)
    mirror = PrefixMirror(metrics, config.model_id, config.block_size)
    follower = MirrorFollower(mirror, index, retry_s=config.index_retry_s)
    follower.start()  # mirrors the index from the nodes' updates; lookups never wait on Redis
    lag_watch = asyncio.get_running_loop().create_task(watch_loop_lag(metrics.loop_lag), name="loop-lag")
    # No connection cap: every streaming request holds one connection to its node.
    session = aiohttp.ClientSession(connector=peer_connector(limit=0))
    background = BackgroundTasks()
    client = NodeClient(session, config.node_connect_timeout_s, config.node_read_timeout_s,
                        config.cluster_token, on_node_down=directory.mark_addr_down)
    policy = app[POLICY]
    # the recent work per node the policy weighs, the same in every router replica
    shared = SharedWork(index, policy.recent) if policy.recent is not None else None
    if shared is not None:
        shared.start()
    dispatcher = Dispatcher(directory, policy, client,
                            app[TOKENIZER], metrics, background, mirror, app[DECISIONS],
                            config.retry_after_s, config.migration_limit)
    store = ResponseStore(config.responses_store_url, config.responses_max_bytes,
                          config.responses_key_max_bytes, config.responses_key_max_entries,
                          config.prepare_thread_bytes)
    app[SERVICES] = RouterServices(registry, index, directory, session, background, dispatcher,
                                   store)
    log.info("router: model %s, policy %s, block size %d, Redis %s (responses: %s), %d nodes known",
             config.model_id, config.policy, config.block_size, redact_url(config.redis_url),
             redact_url(config.responses_store_url), len(directory.nodes))
    try:
        yield
    finally:
        lag_watch.cancel()
        await _within(directory.stop(), "node discovery")
        await follower.stop()
        if shared is not None:
            await shared.stop()
        await background.drain(ABORT_DRAIN_S)
        await session.close()
        await _within(index.close(), "the prefix index's Redis client")
        await _within(registry.close(), "the node registry's Redis client")
        await _within(store.close(), "the response store's Redis client")


async def _within(step, what: str) -> None:
    """Await a shutdown step for at most SHUTDOWN_STEP_S. One stuck on a half-open Redis
    connection (a wrong password over TLS; redis-py can swallow a cancellation inside
    its own read) is cancelled, logged and left behind rather than hang the shutdown."""
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=SHUTDOWN_STEP_S)
    if not done:
        task.cancel()
        log.warning("router: %s did not stop within %.0f s; shutting down without it", what, SHUTDOWN_STEP_S)


@web.middleware
async def _error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Request ids, OpenAI error bodies for every error answer, a 500 JSON body (and
    a logged traceback) for any unexpected exception, and the request counter."""
    client_id = request.headers.get("x-request-id", "")
    request[REQUEST_ID] = client_id[:MAX_REQUEST_ID_LEN] or uuid.uuid4().hex
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except ApiError as e:
        status = e.status
        return e.response()
    except InvalidRequest as e:
        status = 400
        return ApiError.invalid(e).response()
    except web.HTTPException as e:  # aiohttp's own: unknown path (404), wrong method (405)
        status = e.status
        if status < 400:
            raise
        return ApiError(status, f"{e.reason}: {request.method} {request.path}").response(
            headers={k: v for k, v in e.headers.items() if k.lower() == "allow"})
    except asyncio.CancelledError:
        status = 499  # client closed the request
        raise
    except ConnectionResetError:
        status = 499
        raise
    except Exception:
        log.exception("router: unexpected error on %s %s (request %s)", request.method,
                      request.path, request[REQUEST_ID])
        return ApiError(500, "internal error; see the router's log for request "
                        f"{request[REQUEST_ID]}").response()
    finally:
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        request.app[METRICS].requests.labels(endpoint=endpoint, status=str(status)).inc()


@web.middleware
async def _admission_middleware(request: web.Request, handler) -> web.StreamResponse:
    return await request.app[ADMISSION].guard(request, handler)


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-request-id"] = request.get(REQUEST_ID) or uuid.uuid4().hex


class RunningRouter(NamedTuple):
    runner: web.AppRunner
    server: asyncio.Server  # the listening socket (listener.py)
    url: str  # "http://host:port", the port actually bound

    @property
    def admission(self) -> Admission:
        return self.runner.app[ADMISSION]

    async def drain(self, grace_s: float) -> bool:
        """Refuse new requests (503), wait up to ``grace_s`` for in-flight ones;
        True if none was left."""
        self.admission.start_drain()
        return await self.admission.wait_idle(grace_s)

    async def stop(self) -> None:
        """Close the listener, cancel what still runs, close the app's clients."""
        self.server.close()
        await self.runner.cleanup()


async def start_router(config: RouterConfig) -> RunningRouter:
    """Serve the router in the running event loop (tests, embedding)."""
    if config.exposed_without_key:
        log.warning("router: listening on %s with NO API KEY: anyone who can reach this port "
                    "can generate and read /debug/decisions. Pass --api-key (or set "
                    "SPLITSERVE_API_KEY), or bind 127.0.0.1", config.host)
    app = build_app(config)
    # keepalive_timeout: how long a connection may idle between requests (the header
    # timeout is listener.py's). auto_decompress off: compressed bodies are refused
    # (request_body.py), never inflated.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=config.keepalive_timeout_s, auto_decompress=False,
                           lingering_time=LINGER_S, shutdown_timeout=HANDLER_SHUTDOWN_S)
    await runner.setup()
    server = await listen(runner, config.host, config.port, config.max_connections,
                          config.retry_after_s, app[METRICS], config.header_timeout_s)
    host, port = server.sockets[0].getsockname()[:2]
    return RunningRouter(runner, server, f"http://{host}:{port}")


def run_router(config: RouterConfig) -> None:
    """Serve until SIGINT / SIGTERM (``splitserve router``); prints ``READY <url>`` once
    bound. The first signal drains, a second one (or the grace period) stops."""
    raise_file_limit(config.max_connections)

    async def main():
        signalled = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, signalled.set)
        running = await start_router(config)
        log.info("router: listening on %s", running.url)
        print(f"READY {running.url}", flush=True)
        try:
            await signalled.wait()
            signalled.clear()
            inflight = running.admission.inflight
            log.info("router: draining: refusing new requests, %d in flight get up to %g s",
                     inflight, config.drain_grace_s)
            drain = asyncio.create_task(running.drain(config.drain_grace_s))
            second = asyncio.create_task(signalled.wait())
            await asyncio.wait([drain, second], return_when=asyncio.FIRST_COMPLETED)
            second.cancel()
            if not drain.done() or not drain.result():
                drain.cancel()
                log.warning("router: stopping with %d requests still in flight",
                            running.admission.inflight)
        finally:
            await running.stop()

    asyncio.run(main())
