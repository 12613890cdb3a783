"""The TCP backend: the protocol over one non-blocking socket per connection.

Owns: ``TcpConnection`` (framing on a byte stream, scatter-gather sends, reads
straight into the receiver's preallocated buffers), ``TcpSender`` and
``TcpReceiver``. Must not: know the protocol's meaning (``sender_core`` /
``receiver_core``) or import the model. ``TcpControlReceiver`` is also the
listener of the backends that keep their control messages on TCP (ucx, nccl).

Framing on the stream::

    +----------------+---------------------------+------------------------------------+
    | u32 LE hdr_len | wire message (msgpack)    | payload: Blocks.payload_nbytes     |
    |                | hdr_len bytes             | bytes (only after a Blocks header) |
    +----------------+---------------------------+------------------------------------+

A frame goes out with one ``sendmsg`` over [prefix+header, block, block, ...]
(no join copy); the payload is read with ``recv_into`` into the receiver's
staging buffer, so each byte is copied once by the kernel and once into the cache.
"""

from __future__ import annotations

import asyncio
import socket
from abc import abstractmethod
from collections import deque
from collections.abc import Sequence

from ..connection import MAX_HEADER_BYTES, Connection, ConnectionClosed, ConnT, parse_address
from ..receiver_core import FramedReceiver
from ..sender_core import FramedSender
from ..wire import Message, decode, encode

IOV_MAX = 512  # buffers per sendmsg call; Linux allows 1024
SOCKET_BUFFER = 4 << 20  # bytes; bigger kernel buffers keep loopback and LAN links busy


class TcpConnection(Connection):
    """A KV connection over a connected socket, driven by the running asyncio loop."""

    def __init__(self, sock: socket.socket, peer: str):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        self.peer = peer
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._send_lock = asyncio.Lock()
        self._fd = sock.fileno()
        self._prefix = bytearray(4)
        self._closed = False
        self._read_waiter: asyncio.Future[None] | None = None
        self._write_waiter: asyncio.Future[None] | None = None

    @property
    def local_host(self) -> str:
        """This end's address: the interface that reaches the peer (valid until ``close``)."""
        return self._sock.getsockname()[0]

    async def send(self, msg: Message, payload: Sequence[memoryview] = ()) -> None:
        head = encode(msg)
        bufs = deque([memoryview(len(head).to_bytes(4, "little") + head), *payload])
        async with self._send_lock:
            try:
                await self._sendmsg_all(bufs)
            except BaseException:
                self.close()  # part of a frame may be out: the stream can no longer be parsed
                raise

    async def recv(self) -> Message:
        await self._recv_exact(memoryview(self._prefix))
        size = int.from_bytes(self._prefix, "little")
        if size > MAX_HEADER_BYTES:
            self.close()
            raise ConnectionClosed(f"protocol error from {self.peer}: {size}-byte header")
        head = bytearray(size)
        await self._recv_exact(memoryview(head))
        try:
            return decode(head)
        except Exception as e:  # msgspec.DecodeError / ValidationError
            self.close()
            raise ConnectionClosed(f"protocol error from {self.peer}: {e}") from e

    async def recv_payload(self, buf: memoryview) -> None:
        await self._recv_exact(buf)

    def close(self) -> None:
        """Unregister from the loop, wake any waiter with ConnectionClosed, close the socket."""
        if self._closed:
            return
        self._closed = True
        for waiter, remove in ((self._read_waiter, self._loop.remove_reader),
                               (self._write_waiter, self._loop.remove_writer)):
            if waiter is not None:
                remove(self._fd)
                if not waiter.done():
                    waiter.set_exception(ConnectionClosed(f"connection to {self.peer} closed"))
        self._sock.close()

    async def _recv_exact(self, buf: memoryview) -> None:
        got = 0
        while got < len(buf):
            if self._closed:
                raise ConnectionClosed(f"connection to {self.peer} closed")
            try:
                n = self._sock.recv_into(buf[got:])
            except (BlockingIOError, InterruptedError):
                await self._wait(readable=True)
                continue
            except OSError as e:
                raise ConnectionClosed(f"connection to {self.peer}: {e}") from e
            if n == 0:
                raise ConnectionClosed(f"{self.peer} closed the connection")
            got += n

    async def _sendmsg_all(self, bufs: deque[memoryview]) -> None:
        while bufs:
            if self._closed:
                raise ConnectionClosed(f"connection to {self.peer} closed")
            try:
                sent = self._sock.sendmsg([bufs[i] for i in range(min(len(bufs), IOV_MAX))])
            except (BlockingIOError, InterruptedError):
                await self._wait(readable=False)
                continue
            except OSError as e:
                raise ConnectionClosed(f"connection to {self.peer}: {e}") from e
            while sent:  # drop what went out, keep the tail of a partly sent buffer
                head = bufs[0]
                if sent >= len(head):
                    sent -= len(head)
                    bufs.popleft()
                else:
                    bufs[0] = head[sent:]
                    sent = 0

    async def _wait(self, readable: bool) -> None:
        """Until the socket is readable (writable); ``close`` wakes it with ConnectionClosed.
        At most one reader and one writer wait at a time (recv has one caller, send a lock)."""
        fut: asyncio.Future[None] = self._loop.create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        if readable:
            self._read_waiter = fut
            self._loop.add_reader(self._fd, wake)
        else:
            self._write_waiter = fut
            self._loop.add_writer(self._fd, wake)
        try:
            await fut
        finally:
            if readable:
                self._read_waiter = None
            else:
                self._write_waiter = None
            if not self._closed:
                (self._loop.remove_reader if readable else self._loop.remove_writer)(self._fd)


async def dial(host: str, port: int) -> TcpConnection:
    """Connect to ``host:port`` (timeouts are the caller's); raises OSError."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, type_, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, type_, proto)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, sockaddr)
    except BaseException:
        sock.close()
        raise
    return TcpConnection(sock, f"{host}:{port}")


class TcpSender(FramedSender[TcpConnection]):
    scheme = "tcp"

    async def _open(self, addr: str) -> TcpConnection:
        return await dial(*parse_address(addr, self.scheme))


class TcpControlReceiver(FramedReceiver[ConnT]):
    """Listens on ``host:port`` (0: any free port) and serves each accepted TCP connection
    as the backend's connection (``_make_connection``: tcp serves it as is, ucx and nccl add a data path)."""

    _listener: socket.socket | None = None
    _acceptor: asyncio.Task | None = None

    @abstractmethod
    def _make_connection(self, control: TcpConnection) -> ConnT:
        """The backend's connection over the accepted TCP one, ``control``."""

    async def _listen(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._listener = socket.create_server((self.host, self.port), family=family, backlog=128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._acceptor = asyncio.create_task(self._accept_loop(self._listener),
                                             name=f"kv-accept {self.address}")

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, peer = await loop.sock_accept(listener)
            conn = self._make_connection(TcpConnection(sock, f"{peer[0]}:{peer[1]}"))
            loop.create_task(self._serve(conn), name=f"kv-conn {conn.peer}")

    async def _close_listener(self) -> None:
        if self._acceptor is not None:
            self._acceptor.cancel()
            await asyncio.gather(self._acceptor, return_exceptions=True)
            self._acceptor = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class TcpReceiver(TcpControlReceiver[TcpConnection]):
    scheme = "tcp"

    def _make_connection(self, control: TcpConnection) -> TcpConnection:
        return control
