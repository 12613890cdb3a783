"""The router's aiohttp application: routes, error middleware, request ids and the
lifespan that owns its clients.

    build_app(config)            -> web.Application (loads the tokenizer; no I/O yet)
    await start_router(config)   -> RunningRouter (serving; port 0 picks a free port)
    run_router(config)           blocks serving until SIGINT / SIGTERM (the CLI)

The lifespan (cleanup_ctx) creates, in order, the Redis `NodeRegistry`, the node
discovery task, the Redis `KVIndex` (prefix-index reads), the pooled
`aiohttp.ClientSession` to the nodes and the dispatcher, and closes them in reverse
after waiting for pending aborts.

Must not import torch or `splitserve.engine`, or touch tensors.
"""

from __future__ import annotations

import asyncio
import signal
import logging
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple

import aiohttp
from aiohttp import web

from splitserve.common.errors import InvalidRequest
from splitserve.common.kv_index import KVIndex
from splitserve.common.registry import NodeRegistry
from splitserve.router import endpoints, extra_endpoints, openai_api
from splitserve.router.background import BackgroundTasks
from splitserve.router.config import RouterConfig
from splitserve.router.decisions import DecisionLog
from splitserve.router.discovery import NodeDirectory
from splitserve.router.dispatch import Dispatcher
from splitserve.router.errors import ApiError
from splitserve.router.metrics import RouterMetrics
from splitserve.router.node_client import NodeClient
from splitserve.router.policy import make_policy
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.state import (CONFIG, DECISIONS, METRICS, REQUEST_ID, SERVICES, TOKENIZER,
                                     RouterServices)
from splitserve.router.tokenizer import RouterTokenizer

log = logging.getLogger(__name__)

MAX_REQUEST_ID_LEN = 128
ABORT_DRAIN_S = 5.0  # shutdown waits this long for pending aborts to reach the nodes


def build_app(config: RouterConfig) -> web.Application:
    """The router app for ``config``. Raises ValueError naming the setting when the
    model folder is unusable."""
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[_error_middleware])
    app[CONFIG] = config
    app[TOKENIZER] = RouterTokenizer(config.resolved_model_dir, config.max_model_len)
    app[METRICS] = RouterMetrics.create(config.model_id)
    app[DECISIONS] = DecisionLog(app[METRICS])
    make_policy(config.policy, config.weights)  # fail now on a bad name, not at the first request
    app.cleanup_ctx.append(_services)
    app.on_response_prepare.append(_add_request_id)
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
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
    directory = NodeDirectory(registry, config.model_id, metrics, config.poll_interval_s)
    await directory.refresh()  # know the nodes before the first request (Redis may be down)
    if (mismatch := directory.model_mismatch()) is not None:
        await registry.close()
        raise ValueError(mismatch)  # the CLI prints it and exits 2
    directory.start()
    index = KVIndex(config.redis_url, timeout_s=config.index_timeout_s)
    prefix = PrefixIndex(index, metrics, config.model_id, config.block_size,
                         config.index_timeout_s, config.index_retry_s)
    # No connection cap: every streaming request holds one connection to its node.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    background = BackgroundTasks()
    client = NodeClient(session, config.node_connect_timeout_s, config.node_read_timeout_s)
    dispatcher = Dispatcher(directory, make_policy(config.policy, config.weights), client,
                            app[TOKENIZER], metrics, background, prefix, app[DECISIONS])
    app[SERVICES] = RouterServices(registry, index, directory, session, background, dispatcher)
    log.info("router: model %s, policy %s, block size %d, Redis %s, %d nodes known",
             config.model_id, config.policy, config.block_size, config.redis_url,
             len(directory.nodes))
    try:
        yield
    finally:
        await directory.stop()
        await background.drain(ABORT_DRAIN_S)
        await session.close()
        await index.close()
        await registry.close()


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


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-request-id"] = request.get(REQUEST_ID) or uuid.uuid4().hex


class RunningRouter(NamedTuple):
    runner: web.AppRunner
    url: str  # "http://host:port", the port actually bound

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_router(config: RouterConfig) -> RunningRouter:
    """Serve the router in the running event loop (tests, embedding)."""
    runner = web.AppRunner(build_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    return RunningRouter(runner, f"http://{host}:{port}")


def run_router(config: RouterConfig) -> None:
    """Serve until SIGINT / SIGTERM (``splitserve router``); prints ``READY <url>`` once bound."""
    async def main():
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        running = await start_router(config)
        log.info("router: listening on %s", running.url)
        print(f"READY {running.url}", flush=True)
        try:
            await stop.wait()
        finally:
            await running.stop()

    asyncio.run(main())
