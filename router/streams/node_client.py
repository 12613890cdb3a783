"""The router's HTTP client to decode nodes: start a generation and read its token
stream, abort a request.

Owns the wire side of the proxy: ``POST {node}/generate`` (msgpack
`GenerateRequest`) answered by a stream of length-prefixed msgpack `TokenDelta`
frames, or by a 4xx with a msgpack `ErrorBody`; ``POST {node}/abort`` (msgpack
`Abort`, idempotent). Every request carries the cluster token, when the router has
one, in the `CLUSTER_TOKEN_HEADER`. Every failure becomes `NodeRejected` (the node refused the
request: the client's fault) or `NodeUnavailable` (the node failed); a silent node
times out after ``read_timeout_s`` instead of hanging.

Must not own the `aiohttp.ClientSession` (the app's lifespan does), choose nodes,
or detokenize.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import aiohttp
import msgspec

from ...common.auth import auth_headers
from ...common.http import MSGPACK
from ...common.protocol import Abort, ErrorBody, FrameReader, GenerateRequest, TokenDelta

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0
DRAIN_TIMEOUT_S = 0.2  # after the finishing frame, the node is expected to end the body at once
_READ_CHUNK = 1 << 16
# A stream cut by these means the node process or its host went away (not a slow node).
CONNECTION_LOST = (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)


class NodeRejected(Exception):
    """The node answered 4xx: the request itself is bad (or not acceptable there)."""

    def __init__(self, status: int, body: ErrorBody):
        super().__init__(body.message)
        self.status = status
        self.body = body


class NodeUnavailable(Exception):
    """The node could not be reached, answered 5xx, or broke its stream.
    ``retryable``: the request surely did not start there (connection refused, 503),
    so another node may take it; ``unreachable``: the node could not be connected to;
    ``retry_after``: the node answered 503 (up, but not taking this request now: draining,
    compiling its grammar) and asked to be retried after that many seconds."""

    def __init__(self, message: str, retryable: bool = False, unreachable: bool = False,
                 retry_after: str | None = None):
        super().__init__(message)
        self.retryable = retryable or unreachable or retry_after is not None
        self.unreachable = unreachable
        self.retry_after = retry_after


class TokenStream:
    """The open token stream of one request: `deltas()` yields `TokenDelta`s and ends
    after the one that carries a ``finish_reason``. Always `close()` it."""

    def __init__(self, resp: aiohttp.ClientResponse, addr: str,
                 on_node_down: Callable[[str], None] | None = None):
        self._resp = resp
        self._addr = addr
        self._on_node_down = on_node_down
        self._reader = FrameReader(TokenDelta)
        self.finished = False  # the node sent the finishing delta
        self._drained = False  # the body was read to its end

    async def deltas(self) -> AsyncGenerator[TokenDelta, None]:
        try:
            while not self.finished:
                data = await self._resp.content.read(_READ_CHUNK)
                if not data:
                    raise NodeUnavailable(f"decode node {self._addr} closed the token stream "
                                          "before the request finished")
                for delta in self._reader.feed(data):
                    if delta.finish_reason is not None:
                        self.finished = True
                        await self._drain()
                        yield delta
                        break
                    yield delta
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            if self._on_node_down is not None and isinstance(e, CONNECTION_LOST):
                self._on_node_down(self._addr)
            raise NodeUnavailable(f"decode node {self._addr} failed mid-stream: {e!r}") from e
        except msgspec.DecodeError as e:
            raise NodeUnavailable(f"decode node {self._addr} sent a bad frame: {e}") from e

    async def _drain(self) -> None:
        """Read the end of the body after the finishing frame, so the connection goes
        back to the pool; a node that keeps the stream open only loses that."""
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                while await self._resp.content.read(_READ_CHUNK):
                    pass
            self._drained = True
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass

    def close(self) -> None:
        """Let go of the response: a fully read one returns its connection to the
        pool, any other closes it (the node sees its reader gone)."""
        if self._drained:
            self._resp.release()
        else:
            self._resp.close()


@dataclass(slots=True)
class NodeClient:
    session: aiohttp.ClientSession
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 300.0  # longest silence between two frames
    cluster_token: str | None = None  # sent on every request; None: no header
    # Called with a node's address when a connection to it fails or breaks (the directory
    # stops routing there at once, not after its node registry record expires).
    on_node_down: Callable[[str], None] | None = None

    def _headers(self) -> dict[str, str]:
        return {"Content-Type": MSGPACK, **auth_headers(self.cluster_token)}

    async def generate(self, addr: str, req: GenerateRequest) -> TokenStream:
        """Start ``req`` on the decode node at ``addr``; returns once the node accepted
        it (answered 200). Raises `NodeRejected` or `NodeUnavailable`."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s,
                                        sock_read=self.read_timeout_s)
        try:
            resp = await self.session.post(f"{addr}/generate", data=msgspec.msgpack.encode(req),
                                           headers=self._headers(), timeout=timeout)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            if self.on_node_down is not None:
                self.on_node_down(addr)
            raise NodeUnavailable(f"decode node {addr} is unreachable: {e}", unreachable=True) from e
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            # Cut before any answer: the node died (its requests died with it) or closed an idle
            # pooled connection; either way nothing runs there, so another node may take it.
            raise NodeUnavailable(f"decode node {addr} dropped the connection: {e!r}", retryable=True) from e
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise NodeUnavailable(f"decode node {addr} failed: {e!r}") from e
        if resp.status == 200:
            return TokenStream(resp, addr, self.on_node_down)
        try:
            body = await _error_body(resp)
        finally:
            resp.release()
        if 400 <= resp.status < 500:
            raise NodeRejected(resp.status, body)
        raise NodeUnavailable(f"decode node {addr} answered {resp.status}: {body.message}",
                              retry_after=resp.headers.get("Retry-After", "1") if resp.status == 503 else None)

    async def abort(self, addr: str, request_id: str) -> bool:
        """Abort ``request_id`` on the node; True if the node confirmed. Errors are
        logged, never raised (the node also aborts when its stream's reader is gone)."""
        try:
            async with self.session.post(
                    f"{addr}/abort", data=msgspec.msgpack.encode(Abort(request_id)),
                    headers=self._headers(),
                    timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)) as resp:
                if resp.status >= 300:
                    log.warning("abort of %s on %s answered %d", request_id, addr, resp.status)
                return resp.status < 300
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("abort of %s on %s failed: %r", request_id, addr, e)
            return False


async def _error_body(resp: aiohttp.ClientResponse) -> ErrorBody:
    raw = await resp.read()
    try:
        return msgspec.msgpack.decode(raw, type=ErrorBody)
    except msgspec.DecodeError:
        text = raw[:500].decode("utf-8", "replace").strip() or resp.reason or "no body"
        return ErrorBody(message=text, type="upstream_error")
