"""The nccl backend: block payloads through torch.distributed, one two-rank process
group per connection (NCCL when the node's device is CUDA, gloo on CPU: the same
code path, so CPU CI runs it); headers and acks on a TCP control connection.

Owns: ``NcclConnection`` (control + group), ``NcclSender``, ``NcclReceiver`` and the
receiver's ``TCPStore``. Must not: know the protocol's meaning (``sender_core`` /
``receiver_core``), make torch.distributed calls on the event loop
(``pair_group`` runs them on each pair's thread), or import the model.

::

    sender (device D)                                  receiver nccl://host:P (device D')
    TCP dial host:P  -- Hello(group "gloo"|"nccl") -->  TCP control listener :P; refuses another kind
                     <-- Welcome(nccl=(store port S,   TCPStore server :S (every interface),
                                       prefix)) -----  one for the receiver's lifetime
    rank 1 joins PrefixStore(prefix) at host:S  <--->  rank 0 joins the same prefix
                     -- probe, 1 byte ----------------->  (then rank 0 deletes the prefix's keys)
    per frame:  TCP  -- Blocks header ---------------->
                group -- payload: pg.send(uint8) ----->  pg.recv into the staging buffer
                     <-- Ack (TCP) --------------------

Why this shape: torch.distributed wants a rendezvous and a fixed world, a serving
cluster has senders and receivers coming and going. So the protocol stays on the
TCP control connection (handshake, layout check, frame headers with transfer ids,
block ids and checksums, acks: everything the other backends share), and only the
bytes move through a group of exactly two ranks (receiver 0, sender 1), built per
connection from the process group constructors, not ``init_process_group``: one
process holds as many pairs as it has peers, each with its own store prefix.

Devices: both ends take the node's device. CPU makes a gloo group that sends
straight from the packed blocks and receives straight into the staging buffer (no
copy). CUDA makes a NCCL group; the protocol hands it host bytes (a GPU pool's pack is
staged once into pinned memory), so a payload goes the sender's pool -> pinned host ->
the sender's GPU -> NCCL -> the receiver's GPU -> host staging, where the receiver
verifies checksums (on its device for wsum32_v1) and lands blocks exactly as on the
other backends. Sending the packed device rows straight through NCCL would skip both
host hops; same-host pairs use the ipc backend instead. Both ends must be of one kind: the Hello names the sender's, and the
receiver refuses another kind before any group exists (both sides name both kinds).
NCCL cannot pair two ranks on one GPU, so a same-host pair needs two devices.

Failure: a dead peer closes the control connection (EOF: the sender fails every
pending frame, the receiver reports a cut frame's blocks ok=False); a stalled one hits
the op timeout (sender: ``timeout_s``; receiver: ``PAYLOAD_TIMEOUT_S`` per payload,
posted only once its header arrived). ``close``/``stop`` never wait for a
torch.distributed call; ``pair_group`` says how its thread ends.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from ..connection import Connection, ConnectionClosed, coalesce, parse_address
from ..errors import TransferError
from .pair_group import PairGroup, check_available, group_kind, payload_device
from ..sender_core import FramedSender, Peer
from .tcp import TcpConnection, TcpControlReceiver, dial
from ..wire import Hello, Message, NcclInfo, Refused, Welcome

if TYPE_CHECKING:
    from torch.distributed import TCPStore

PREFIX_BYTES = 8  # random bytes naming a connection in the receiver's store
ATTACH_TIMEOUT_S = 10.0  # a receiver waits this long for the sender to join the group
PAYLOAD_TIMEOUT_S = 30.0  # a receiver waits this long for a payload whose header arrived


class NcclConnection(Connection):
    """A TCP control connection plus its process group, which carries payloads."""

    def __init__(self, control: TcpConnection, device: torch.device, op_timeout_s: float,
                 prefix: str = ""):
        self.peer = control.peer
        self.local_host = control.local_host
        self.prefix = prefix  # receiver side: this connection's keys in the store
        self.pair = PairGroup(device, control.peer)
        self._control = control
        self._op_timeout_s = op_timeout_s
        self._joined: asyncio.Future[None] | None = None  # the pair's open(), once started
        self._send_lock = asyncio.Lock()  # a header and its payload go out together
        self._in_flight: deque[asyncio.Future[None]] = deque()  # payload sends not yet reaped
        self._closed = False

    def join(self, rank: int, store_host: str, store_port: int, prefix: str,
             timeout_s: float) -> asyncio.Future[None]:
        """Start joining the group as ``rank``; the future resolves once the pair is up
        (``recv_payload`` awaits it too). Raises ``ConnectionClosed`` through the future."""
        self._joined = self.pair.open(rank, store_host, store_port, prefix, self.local_host, timeout_s)
        self._joined.add_done_callback(lambda f: f.cancelled() or f.exception())  # always retrieved
        return self._joined

    async def send(self, msg: Message, payload: Sequence[memoryview] = ()) -> None:
        """Header on TCP, then the payload queued on the pair's thread without waiting: the
        thread sends in order, the Ack tells of delivery, ``flush`` frees the buffers."""
        async with self._send_lock:
            await self._control.send(msg)
            if payload:
                sent = self.pair.send(_one_buffer(payload), self._op_timeout_s)
                sent.add_done_callback(self._check_sent)
                self._in_flight.append(sent)
                while self._in_flight and self._in_flight[0].done():
                    self._in_flight.popleft()

    async def flush(self) -> None:
        """Wait for every payload sent so far (concurrent flushes each wait on their own list)."""
        for sent in list(self._in_flight):
            await asyncio.shield(sent)  # raises ConnectionClosed if it failed

    async def recv(self) -> Message:
        return await self._control.recv()

    async def recv_payload(self, buf: memoryview) -> None:
        try:
            if self._joined is None:
                raise ConnectionClosed(f"no process group with {self.peer}")
            await asyncio.shield(self._joined)
            await self.pair.recv(buf, self._op_timeout_s)
        except ConnectionClosed:
            self.close()
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._control.close()
        self.pair.close()

    def _check_sent(self, fut: asyncio.Future[None]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            self.close()  # the header is out without its payload: the stream is lost


def _one_buffer(views: Sequence[memoryview]) -> memoryview:
    """The frame's blocks as one buffer: a view when they are adjacent, else a fresh join."""
    one = coalesce(views)
    if one is not None:
        return one
    joined = bytearray(sum(len(v) for v in views))
    pos = 0
    for v in views:
        joined[pos:pos + len(v)] = v
        pos += len(v)
    return memoryview(joined)


class NcclSender(FramedSender[NcclConnection]):
    """Joins each receiver's group as rank 1; ``device`` must be of the receivers' kind."""

    scheme = "nccl"
    # Each frame is one hand-off to the pair thread and one send/recv rendezvous; on a loaded
    # 2-core host 2 MiB frames measured slower, 8 and 32 MiB alike (8 reports blocks sooner).
    default_frame_bytes = 8 << 20

    def __init__(self, *args, device: str | torch.device = "cpu", **kwargs):
        super().__init__(*args, **kwargs)
        self.device = payload_device(device)
        check_available(self.device)

    async def _open(self, addr: str) -> NcclConnection:
        control = await dial(*parse_address(addr, self.scheme))
        return NcclConnection(control, self.device, self.options.timeout_s)

    def _hello(self) -> Hello:
        return Hello(layout=self.layout, checksum=self.checksum_algo, group=group_kind(self.device))

    async def _on_welcome(self, peer: Peer[NcclConnection]) -> None:
        info = peer.welcome.nccl
        if info is None:
            raise TransferError(f"receiver {peer.addr} offers no process group; use its backend")
        host, _ = parse_address(peer.addr, self.scheme)
        await peer.conn.join(1, host, info.store_port, info.prefix, self.options.connect_timeout_s)


class NcclReceiver(TcpControlReceiver[NcclConnection]):
    """TCP control on ``host:port``; a ``TCPStore`` on any free port of every interface."""

    scheme = "nccl"
    _store: TCPStore | None = None  # from _listen to _close_listener

    def __init__(self, *args, device: str | torch.device = "cpu", **kwargs):
        super().__init__(*args, **kwargs)
        self.device = payload_device(device)
        check_available(self.device)

    async def _listen(self) -> None:
        import torch.distributed as dist

        self._store = await asyncio.to_thread(
            dist.TCPStore, self.host, 0, None, True, timedelta(seconds=ATTACH_TIMEOUT_S),
            wait_for_workers=False)
        await super()._listen()

    def _make_connection(self, control: TcpConnection) -> NcclConnection:
        return NcclConnection(control, self.device, PAYLOAD_TIMEOUT_S,
                           prefix=secrets.token_hex(PREFIX_BYTES))

    def _check_hello(self, hello: Hello) -> Refused | None:
        refusal = super()._check_hello(hello)
        mine = group_kind(self.device)
        if refusal is None and hello.group != mine:
            return Refused(f"sender moves payloads with {hello.group or 'no process group'}, receiver "
                           f"{self.address} with {mine} (device {self.device}): run both nodes on "
                           f"the same device type (cpu: gloo, cuda: nccl)")
        return refusal

    def _welcome(self, conn: NcclConnection) -> Welcome:
        assert self._store is not None, "a handshake runs only while listening"
        info = NcclInfo(store_port=self._store.port, prefix=conn.prefix)
        return Welcome(layout=self.layout, num_blocks=self.store.num_blocks, nccl=info)

    async def _handshake(self, conn: NcclConnection) -> bool:
        """After a Welcome, start joining the group as rank 0; ``recv_payload`` awaits it."""
        if not await super()._handshake(conn):
            return False
        assert self._store is not None, "a handshake runs only while listening"
        conn.join(0, conn.local_host, self._store.port, conn.prefix, ATTACH_TIMEOUT_S)
        return True

    async def _close_listener(self) -> None:
        await super()._close_listener()
        self._store = None  # stops the store server; pairs already joined keep working
