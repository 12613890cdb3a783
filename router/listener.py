"""The router's listening socket, with a cap on open client connections.

    accept -> fewer than max_connections open?  yes: aiohttp's request handler
                                                no:  "503 + Retry-After", then close

What bounds a slow client (aiohttp's own settings, set in app.py): a connection
must deliver a request's headers within the header timeout (aiohttp's keep-alive
timer runs from the connection's start and closes a connection still waiting for a
complete request), and the body within the body timeout (request_body.py). So a
slowloris attacker holds at most ``max_connections`` sockets, each for at most the
header timeout, and the refusal costs one write.

Must not parse HTTP (aiohttp does) or know about routes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass

from aiohttp import web

from .metrics import RouterMetrics

log = logging.getLogger(__name__)

REFUSE_LINGER_S = 1.0  # a refused connection stays open this long for the client to read
BACKLOG = 1024  # pending connections the kernel queues before accept
SPARE_FILES = 256  # Redis, the tokenizer, logs, refused connections in their linger


def refusal_bytes(max_connections: int, retry_after_s: int) -> bytes:
    """The whole HTTP answer to a connection over the cap."""
    body = json.dumps({"error": {
        "message": f"the router has its limit of {max_connections} open connections; retry "
                   "shortly", "type": "service_unavailable", "param": None,
        "code": "too_many_connections"}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: {retry_after_s}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body


class _Refuse(asyncio.Protocol):
    """Answers 503 at once and closes once the client's request arrived (or after
    REFUSE_LINGER_S), so the close does not reset the answer away."""

    def __init__(self, answer: bytes):
        self._answer = answer
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(self._answer)
        self._timer = asyncio.get_running_loop().call_later(REFUSE_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None


@dataclass(slots=True)
class CappedProtocolFactory:
    """``loop.create_server``'s protocol factory: aiohttp's handler while fewer than
    ``max_connections`` are open, a `_Refuse` beyond."""

    server: web.Server
    max_connections: int
    answer: bytes  # refusal_bytes(...)
    metrics: RouterMetrics

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) >= self.max_connections:
            self.metrics.admission_rejections.labels(reason="connections").inc()
            return _Refuse(self.answer)
        return self.server()


async def listen(runner: web.AppRunner, host: str, port: int, max_connections: int,
                 retry_after_s: int, metrics: RouterMetrics) -> asyncio.Server:
    """Serve ``runner`` (set up) on ``host:port`` (0: a free port) with the cap."""
    assert runner.server is not None, "runner.setup() first"
    factory = CappedProtocolFactory(runner.server, max_connections,
                                    refusal_bytes(max_connections, retry_after_s), metrics)
    return await asyncio.get_running_loop().create_server(
        factory, host, port, reuse_address=True, backlog=BACKLOG)


def raise_file_limit(max_connections: int) -> None:
    """Raise this process's open-file limit to fit ``max_connections`` clients plus one
    node connection each (the CLI calls this; a test process is left alone)."""
    want = 2 * max_connections + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < want:
        log.warning("router: the open-file limit is %d; --max-connections %d needs about %d "
                    "(raise the hard limit, or lower --max-connections)", new, max_connections,
                    want)
