"""The UCX backend, through ucxx (package ucxx-cu12): block payloads on a UCX endpoint,
headers and acks on a TCP control connection.

Owns: ``UcxConnection`` (control + data), ``UcxSender``, ``UcxReceiver`` and the
UCX environment defaults. Must not: know the protocol's meaning
(``sender_core`` / ``receiver_core``), or import the model.

::

    sender                                              receiver (ucx://host:P)
    TCP dial host:P  -- Hello ------------------------>  TCP control listener :P
                     <-- Welcome(ucx=(port U, token)) --
    ucxx.create_endpoint(host, U) -- token (16 B) ----->  UCX listener :U binds the endpoint
                                                         to the connection holding that token
    per frame:  TCP  -- Blocks header ---------------->
                UCX  -- payload, one message ---------->  ep.recv straight into the staging buffer
                     <-- Ack (TCP) --------------------

Why the split: waiting on a UCX request means polling it (ucxx's notifier-thread
mode avoids that but is slower and binds ucxx to the first event loop), so a
receive left posted between transfers would burn a core (measured: 1.0 s CPU per
idle second). Here a UCX request is posted only while its payload is on the
way; idle connections wait on TCP and cost ~2% of a core (the progress thread). A dead
peer is seen on both planes: TCP EOF on the control connection, and UCX endpoint
error handling, which cancels a payload in flight.

A frame's block views go out as one message without a copy when they are
consecutive slices of one buffer (``KVBlockStore.split(pack(...))``), else joined.

Environment: ucxx reads UCX settings when it first initialises, so loading this
backend sets, unless already set (``UCX_ENV_DEFAULTS``): ``UCX_TLS=tcp`` (the KV
cache is host memory; shared-memory UCX transports would need worker-address
endpoints with endpoint error handling off, and we rely on error handling),
``UCX_RNDV_FRAG_MEM_TYPE=host`` (ucxx asks for CUDA fragment memory otherwise),
put-zcopy rendezvous and thread progress (reasons below). ucxx keeps one UCX
context per process.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections import deque
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol

from ..connection import Connection, ConnectionClosed, coalesce, parse_address
from ..errors import TransferError
from ..sender_core import FramedSender, Peer
from .tcp import TcpConnection, TcpControlReceiver, dial
from ..wire import Message, UcxInfo, Welcome

TOKEN_BYTES = 16
ATTACH_TIMEOUT_S = 10.0  # a receiver waits this long for the sender's UCX endpoint
SPIN_S = 0.0005  # poll a UCX receive without sleeping this long (one block takes ~0.5 ms)...
POLL_S = 0.001  # ...then once per millisecond (asyncio's timer resolution)
UCX_ENV_DEFAULTS = {
    "UCX_TLS": "tcp",
    "UCX_RNDV_FRAG_MEM_TYPE": "host",
    # Rendezvous by zero-copy put: raw ucxx between two processes 0.65 -> ~1.4 GB/s.
    "UCX_RNDV_SCHEME": "put_zcopy",
    # A progress thread. ucxx's "blocking" mode is faster in a bare benchmark but, once an
    # event arrived, progresses on every loop turn: 100% of a core even when idle.
    "UCXPY_PROGRESS_MODE": "thread",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


class UcxRequest(Protocol):
    """A posted ucxx request: what ``_wait`` and ``flush`` read of it (ucxx has no stubs)."""

    @property
    def completed(self) -> bool: ...
    def check_error(self) -> None: ...


class UcxEndpoint(Protocol):
    """A ucxx ``Endpoint``: what this module calls on it (``_post`` reaches two internals)."""

    _ep: Any  # the libucxx endpoint
    _tags: dict[str, int]

    def abort(self) -> None: ...
    async def send(self, buffer: bytes) -> None: ...
    async def recv(self, buffer: bytearray) -> None: ...


class UcxListener(Protocol):
    """A ucxx ``Listener``."""

    port: int

    def close(self) -> None: ...


def load_ucxx() -> ModuleType:
    """Import ucxx with the CPU defaults above; ``TransferError`` naming the reason if it cannot."""
    for key, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import ucxx
    except Exception as e:  # ImportError, or a missing shared library
        raise TransferError(f"ucx backend unavailable: cannot import ucxx ({type(e).__name__}: {e}); "
                            f"pip install ucxx-cu12, or use the tcp backend") from e
    return ucxx


def _post(endpoint: UcxEndpoint, buf: memoryview, send: bool) -> UcxRequest:
    """Post one tagged send / receive of ``buf`` on a ucxx ``Endpoint``; the request.

    ucxx's own ``Endpoint.send/recv`` also wait, with ``asyncio.sleep(0)`` in a loop, which
    on a busy host takes the core from the progress thread doing the work. We post the same
    request (the endpoint's ``_ep`` and ``_tags``: ucxx-cu12 0.52 internals, pinned in
    deploy/requirements.txt) and wait our own way (``_wait``), or not at all (sends).
    """
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    if send:
        return endpoint._ep.tag_send(Array(buf), Tag(endpoint._tags["msg_send"]))
    return endpoint._ep.tag_recv(Array(buf), Tag(endpoint._tags["msg_recv"]), TagMaskFull)


async def _wait(request: UcxRequest) -> None:
    """Poll a request: tightly for SPIN_S, then once per loop tick; raise its error."""
    loop = asyncio.get_running_loop()
    spin_until = loop.time() + SPIN_S
    while not request.completed:
        await asyncio.sleep(0 if loop.time() < spin_until else POLL_S)
    request.check_error()


class UcxConnection(Connection):
    """A TCP control connection plus, once attached, the UCX endpoint that carries payloads."""

    def __init__(self, control: TcpConnection, token: str):
        self.peer = control.peer
        self.token = token  # hex; names this connection to the UCX listener
        self._control = control
        self._ep: UcxEndpoint | None = None
        self._attached: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._send_lock = asyncio.Lock()  # a header and its payload go out together
        self._join = bytearray(0)  # reused when a payload's views are not one buffer
        # Payload sends posted and not yet reaped: (request, the buffer it reads).
        self._in_flight: deque[tuple[UcxRequest, memoryview]] = deque()
        self._closed = False

    def attach(self, endpoint: UcxEndpoint) -> None:
        if self._closed or self._attached.done():
            endpoint.abort()
            return
        self._ep = endpoint
        self._attached.set_result(None)

    async def send(self, msg: Message, payload: Sequence[memoryview] = ()) -> None:
        """Header on TCP, then the payload posted on the endpoint without waiting for it:
        UCX keeps one endpoint's tagged messages in order, so the next frame may follow at
        once, and the sender learns of delivery from the receiver's Ack (``flush`` reaps)."""
        async with self._send_lock:
            await self._control.send(msg)
            if payload:
                ep = await self._endpoint()
                buf = self._one_buffer(payload)
                try:
                    self._in_flight.append((_post(ep, buf, send=True), buf))
                    while self._in_flight and self._in_flight[0][0].completed:
                        self._in_flight.popleft()[0].check_error()
                except Exception as e:
                    self.close()  # a payload failed, or the header is out without its payload
                    raise ConnectionClosed(f"ucx endpoint to {self.peer}: {type(e).__name__}: {e}") from e

    async def flush(self) -> None:
        try:
            while self._in_flight:
                await _wait(self._in_flight[0][0])
                self._in_flight.popleft()
        except Exception as e:
            self.close()
            raise ConnectionClosed(f"ucx endpoint to {self.peer}: {type(e).__name__}: {e}") from e

    async def recv(self) -> Message:
        return await self._control.recv()

    async def recv_payload(self, buf: memoryview) -> None:
        ep = await self._endpoint()
        try:
            await _wait(_post(ep, buf, send=False))
        except Exception as e:
            self.close()
            raise ConnectionClosed(f"ucx endpoint from {self.peer}: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._control.close()
        if not self._attached.done():
            self._attached.set_exception(ConnectionClosed(f"connection to {self.peer} closed"))
            self._attached.exception()  # retrieved: nobody may be waiting
        if self._ep is not None:
            self._ep.abort()  # cancels a payload in flight; the peer's endpoint errors out

    async def _endpoint(self) -> UcxEndpoint:
        if self._closed:
            raise ConnectionClosed(f"connection to {self.peer} closed")
        try:
            await asyncio.wait_for(asyncio.shield(self._attached), ATTACH_TIMEOUT_S)
        except TimeoutError:
            self.close()
            raise ConnectionClosed(f"no ucx endpoint from {self.peer} within {ATTACH_TIMEOUT_S}s") from None
        assert self._ep is not None  # _attached resolves only in attach, after setting it
        return self._ep

    def _one_buffer(self, views: Sequence[memoryview]) -> memoryview:
        one = coalesce(views)
        if one is not None:
            return one
        total = sum(len(v) for v in views)
        if len(self._join) < total or self._in_flight:  # never overwrite a buffer in flight
            self._join = bytearray(total)
        pos = 0
        for v in views:
            self._join[pos:pos + len(v)] = v
            pos += len(v)
        return memoryview(self._join)[:total]


class UcxSender(FramedSender[UcxConnection]):
    scheme = "ucx"
    default_frame_bytes = 32 << 20  # each frame costs a polled receive: fewer, bigger frames

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ucxx = load_ucxx()

    async def _open(self, addr: str) -> UcxConnection:
        return UcxConnection(await dial(*parse_address(addr, self.scheme)), token="")

    async def _on_welcome(self, peer: Peer[UcxConnection]) -> None:
        info = peer.welcome.ucx
        if info is None:
            raise TransferError(f"receiver {peer.addr} offers no ucx endpoint; use its backend")
        host, _ = parse_address(peer.addr, self.scheme)
        try:
            endpoint = await self._ucxx.create_endpoint(
                host, info.port, connect_timeout=self.options.connect_timeout_s)
            await endpoint.send(bytes.fromhex(info.token))
        except Exception as e:  # ucxx raises its own error types, not OSError
            raise TransferError(f"cannot open the ucx endpoint of {peer.addr} (port {info.port}): "
                                f"{type(e).__name__}: {e}") from e
        peer.conn.attach(endpoint)


class UcxReceiver(TcpControlReceiver[UcxConnection]):
    """TCP control on ``host:port``; a UCX listener on any free port of every interface."""

    scheme = "ucx"
    _ucx_listener: UcxListener | None = None  # from _listen to _close_listener

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ucxx = load_ucxx()
        self._by_token: dict[str, UcxConnection] = {}  # token -> connection awaiting its endpoint

    async def _listen(self) -> None:
        self._ucx_listener = self._ucxx.create_listener(self._on_endpoint)
        await super()._listen()

    def _make_connection(self, control: TcpConnection) -> UcxConnection:
        conn = UcxConnection(control, token=secrets.token_hex(TOKEN_BYTES))
        self._by_token[conn.token] = conn
        return conn

    def _welcome(self, conn: UcxConnection) -> Welcome:
        assert self._ucx_listener is not None, "a handshake runs only while listening"
        info = UcxInfo(port=self._ucx_listener.port, token=conn.token)
        return Welcome(layout=self.layout, num_blocks=self.store.num_blocks, ucx=info)

    async def _on_endpoint(self, endpoint: UcxEndpoint) -> None:
        token = bytearray(TOKEN_BYTES)
        try:
            await asyncio.wait_for(endpoint.recv(token), ATTACH_TIMEOUT_S)
        except Exception:
            endpoint.abort()
            return
        conn = self._by_token.pop(token.hex(), None)
        if conn is None:
            endpoint.abort()  # unknown token: not one of our connections
        else:
            conn.attach(endpoint)

    async def _serve(self, conn: UcxConnection) -> None:
        try:
            await super()._serve(conn)
        finally:
            self._by_token.pop(conn.token, None)

    async def _close_listener(self) -> None:
        await super()._close_listener()
        if self._ucx_listener is not None:
            self._ucx_listener.close()
            # ucxx warns when a Listener is collected while its handlers run; keep it until we go.
            self._closed_ucx_listener, self._ucx_listener = self._ucx_listener, None
