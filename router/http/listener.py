"""The router's listening socket: a cap on open client connections, and a header
timeout kept apart from the idle keep-alive time.

    accept -> fewer than max_connections open?  yes: aiohttp's request handler, behind
                                                     a `HeaderTimer`
                                                no:  "503 + Retry-After", then close

What bounds a slow client: a request's headers must be complete within the header
timeout of its first byte (the connection's first request: of the connection's
start; `HeaderTimer`), and its body within the body timeout (request_body.py). So a
slowloris attacker holds at most ``max_connections`` sockets, each for at most the
header timeout, and the refusal costs one write. Between requests a connection may
idle for the keep-alive time (aiohttp's keepalive_timeout, set in app.py), which is
longer than clients' own idle timeouts: the client closes an idle connection first,
so it never sends a request into one the router is closing.

Must not parse HTTP (aiohttp does) or know about routes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass

from aiohttp import web

from ..metrics import RouterMetrics

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


class HeaderTimer(asyncio.Protocol):
    """aiohttp's request handler for one connection, behind a timer: the connection is
    closed when a request's headers are not complete ``timeout_s`` after its first
    byte arrived (the first request's: after the connection opened). The app's
    `header_timer_middleware` reports when a request's headers are complete and when
    its handler is done; bytes arriving in between are its body, bounded by the body
    timeout. Every protocol call is passed on to the handler."""

    def __init__(self, handler: asyncio.Protocol, timeout_s: float,
                 timers: dict[object, "HeaderTimer"]):
        self._handler = handler
        self._timeout_s = timeout_s
        self._timers = timers  # handler -> its HeaderTimer, for the middleware
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_request = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._timers[self._handler] = self
        self._handler.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if data and not self._in_request:
            self._arm()
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._transport = None
        self._timers.pop(self._handler, None)
        self._handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def request_started(self) -> None:
        """The request's headers are complete: its handler runs."""
        self._in_request = True
        self._disarm()

    def request_finished(self) -> None:
        """The handler returned: the next byte starts the next request."""
        self._in_request = False

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._transport is not None:
            self._transport.close()


@web.middleware
async def header_timer_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Tells the connection's `HeaderTimer` (none when the app is served some other
    way) that a request's headers are complete, and when its handler is done."""
    timer = request.app[HEADER_TIMERS].get(request.protocol)
    if timer is None:
        return await handler(request)
    timer.request_started()
    try:
        return await handler(request)
    finally:
        timer.request_finished()


HEADER_TIMERS = web.AppKey("header_timers", dict)  # request handler -> HeaderTimer


@dataclass(slots=True)
class CappedProtocolFactory:
    """``loop.create_server``'s protocol factory: aiohttp's handler behind a
    `HeaderTimer` while fewer than ``max_connections`` are open, a `_Refuse` beyond."""

    server: web.Server
    max_connections: int
    answer: bytes  # refusal_bytes(...)
    metrics: RouterMetrics
    header_timeout_s: float
    timers: dict  # the app's HEADER_TIMERS

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) >= self.max_connections:
            self.metrics.admission_rejections.labels(reason="connections").inc()
            return _Refuse(self.answer)
        return HeaderTimer(self.server(), self.header_timeout_s, self.timers)


async def listen(runner: web.AppRunner, host: str, port: int, max_connections: int,
                 retry_after_s: int, metrics: RouterMetrics, header_timeout_s: float) -> asyncio.Server:
    """Serve ``runner`` (set up; its app has `header_timer_middleware`) on ``host:port``
    (0: a free port) with the cap and the header timeout."""
    assert runner.server is not None, "runner.setup() first"
    factory = CappedProtocolFactory(runner.server, max_connections,
                                    refusal_bytes(max_connections, retry_after_s), metrics,
                                    header_timeout_s, runner.app[HEADER_TIMERS])
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
