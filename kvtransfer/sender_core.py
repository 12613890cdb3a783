"""The sender half of the protocol, over any ``Connection``.

Owns: its connections (one per receiver address, reused; with what the sender knows of
that receiver, a ``Peer``), the client side of the handshake, cutting a transfer into
frames, checksums, acknowledgements, timeouts, and fault injection. Must not: do socket
I/O itself (a backend subclass opens connections and may change how a frame's bytes
travel) or import the model.

Per connection::

    send_blocks --frames--> peer.conn.send(Blocks(seq), payload) ----> receiver
         ^                                                                  |
         +--- await futures[seq] <--- reader task <--- Ack(seq) ------------+

The reader task resolves each frame's future; if the connection fails it fails every
pending future, so no ``send_blocks`` waits on a dead peer. A timeout drops the
connection (the next transfer dials again); a cancelled ``send_blocks`` leaves
it to the others unless it was cut mid-frame, in which case the connection
closes itself (a half-written frame makes the stream unparsable).

A sender is one rank's (``KVShard``): it sends blocks of its cache, or slices of them
(``heads``: the KV heads a decode rank needs, ``tp_plan.py``), and checks before any byte
moves that the receiver's key is compatible and that the slice lies in the receiver's heads.
"""

from __future__ import annotations

import asyncio
import logging
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple

from ..common.kv_heads import HeadRange
from .base import KVSender
from .block_store import CHECKSUM_ALGO, KVBlockStore
from .connection import ConnectionClosed, ConnT
from .errors import TransferError
from .layout import KVLayout, KVShard, LayoutMismatch
from .packed import frame_sums, frame_views, item_nbytes
from .wire import Ack, Blocks, Hello, Refused, Welcome, layout_id

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SenderOptions:
    """Tuning and test knobs of a sender; resolved once (``factory.sender_options``)."""

    connect_timeout_s: float = 5.0  # dial + handshake
    timeout_s: float = 60.0  # one send_blocks call, end to end
    # Frames hold whole blocks: at least one, at most this many bytes. None: the backend's
    # default (tcp, shm: 2 MiB; ucx: 32 MiB, which pays a poll per frame; nccl: 8 MiB, which
    # pays a thread hand-off and a send/recv rendezvous per frame).
    max_frame_bytes: int | None = None
    corrupt_every: int = 0  # fault injection: flip one byte of every Nth block after its checksum
    # Block checksum of every connection (wire.CHECKSUM_ALGOS). None: the backend's default
    # (xxh3_64; ``make_sender`` picks wsum32_v1, computed on the device, for a GPU node).
    checksum: str | None = None
    cluster_token: str | None = field(default=None, repr=False)  # sent in every Hello


class Slice(NamedTuple):
    """What one ``send_blocks`` call moves of each block: KV heads ``heads`` (global)."""

    heads: HeadRange
    layout: KVLayout  # of one slice: the sender's layout with heads.size heads
    layout_id: int  # layout_id(layout), repeated in every frame
    peer_local: HeadRange  # the heads in the receiver's cache (where shm / ipc write them)


@dataclass(slots=True, eq=False)
class Peer(Generic[ConnT]):
    """One receiver as this sender knows it: the live connection to it, its Welcome, the
    frames awaiting its Ack."""

    addr: str
    conn: ConnT
    welcome: Welcome
    pending: dict[int, asyncio.Future[Ack]] = field(default_factory=dict)  # seq -> future of its Ack
    next_seq: int = 0
    broken: str | None = None  # why it can no longer carry frames
    reader: asyncio.Task | None = None
    store: KVBlockStore | None = None  # the receiver's cache, mapped here (shm, ipc)
    shard: KVShard | None = None  # the receiver's rank, from its Welcome

    def fail(self, reason: str) -> None:
        """Mark broken, close the connection, fail every pending frame (idempotent)."""
        if self.broken is None:
            self.broken = reason
        self.conn.close()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(TransferError(f"connection to {self.addr} lost: {self.broken}"))
        self.pending.clear()


class FramedSender(KVSender, Generic[ConnT]):
    """``KVSender`` over connections of type ``ConnT``; a backend implements ``_open`` (and may
    override ``_hello``, ``_on_welcome``, ``_stage``, ``_deliver``)."""

    scheme: str = ""  # address scheme, "tcp", "shm", "ucx"
    default_frame_bytes: int = 2 << 20  # measured best for tcp and shm (realistic 720 KiB blocks)

    def __init__(self, layout: KVLayout, options: SenderOptions | None = None,
                 shard: KVShard | None = None, device: object = "cpu"):
        # device: the node's compute device; a backend moving host bytes ignores it (nccl's takes it)
        self.shard = shard or KVShard.of_layout(layout)
        if (why := self.shard.problem()) is not None or self.shard.layout != layout:
            raise ValueError(f"sender: shard {self.shard} does not hold a cache of {layout}"
                             + (f": {why}" if why else ""))
        self.layout = layout
        self.options = options or SenderOptions()
        self.checksum_algo = self.options.checksum or CHECKSUM_ALGO
        self._peers: dict[str, Peer[ConnT]] = {}  # addr -> the receiver there, connected
        self._dialing: dict[str, asyncio.Lock] = {}  # addr -> lock held while dialing it
        self._blocks_sent = 0  # counts blocks for corrupt_every

    # -- backend hooks -------------------------------------------------------------
    @abstractmethod
    async def _open(self, addr: str) -> ConnT:
        """Dial ``addr``; raise ``TransferError`` / ``OSError`` / ``ConnectionClosed`` on failure."""

    def _hello(self) -> Hello:
        return Hello(layout=self.layout, checksum=self.checksum_algo)

    async def _on_welcome(self, peer: Peer[ConnT]) -> None:
        """Finish a backend's connection from the welcome (shm: map the cache, ucx: open the
        data endpoint); raise ``TransferError`` to refuse it. Runs under the connect timeout."""

    def _stage(self, peer: Peer[ConnT], dest: list[int], items: list,
               corrupt: list[int], part: Slice) -> tuple[list[int], list[memoryview]]:
        """(checksum of each block, the buffers to send). ``items``: host buffers or
        ``PackedBlock`` rows of a device pack (hashed on the device, staged to host once),
        each one slice ``part`` of a block. Fault injection damages the ``corrupt`` blocks
        after their checksum was taken. The shm backend overrides this to copy each block
        into place right after hashing it, the ipc backend to copy device to device."""
        sums = frame_sums(items, part.layout, self.checksum_algo)
        views = frame_views(items)
        return sums, [flip_one_byte(v) if i in corrupt else v for i, v in enumerate(views)]

    async def _deliver(self, peer: Peer[ConnT], frame: Blocks, payload: list[memoryview]) -> None:
        """Make the frame reach the receiver. Default: the blocks inline after the header."""
        frame.payload_nbytes = sum(len(v) for v in payload)
        await peer.conn.send(frame, payload)

    # -- KVSender --------------------------------------------------------------------
    async def connect(self, addr: str) -> None:
        await self._peer(addr)

    async def send_blocks(self, addr: str, transfer_id: str,
                          blocks: Sequence[tuple[int, object]], heads: HeadRange | None = None) -> None:
        if not blocks:
            return
        mine = self.shard.heads
        heads = mine if heads is None else HeadRange(*heads)
        if not mine.contains(heads):
            raise TransferError(f"transfer {transfer_id}: heads [{heads.start}, {heads.stop}) are not "
                                f"all held by this sender, {self.shard.describe()}")
        layout = self.layout.with_heads(heads.size)
        items = [data for _, data in blocks]  # host buffers or PackedBlock rows
        sizes = [item_nbytes(it) for it in items]
        bad = [i for i, n in enumerate(sizes) if n != layout.block_nbytes]
        if bad:
            raise TransferError(f"transfer {transfer_id}: block #{bad[0]} has {sizes[bad[0]]} "
                                f"bytes, a packed slice of {layout} has {layout.block_nbytes}")
        dest = [int(d) for d, _ in blocks]
        peer: Peer[ConnT] | None = None
        try:
            async with asyncio.timeout(self.options.timeout_s):
                peer = await self._peer(addr)
                if any(not 0 <= d < peer.welcome.num_blocks for d in dest):
                    raise TransferError(f"transfer {transfer_id}: destination block ids must be in "
                                        f"[0, {peer.welcome.num_blocks}) at {addr}, got {dest}")
                part = self._slice(peer, transfer_id, heads, layout)
                frame_bytes = self.options.max_frame_bytes or self.default_frame_bytes
                per_frame = max(1, frame_bytes // layout.block_nbytes)
                futures = []
                for start in range(0, len(blocks), per_frame):
                    futures.append(await self._send_frame(peer, transfer_id, dest[start:start + per_frame],
                                                          items[start:start + per_frame], part))
                acks = await _gather(futures)
                await peer.conn.flush()  # the caller may reuse the block buffers after return
        except TimeoutError:
            if peer is not None:
                peer.fail(f"no acknowledgement within {self.options.timeout_s}s")
            raise TransferError(f"transfer {transfer_id} to {addr} timed out after "
                                f"{self.options.timeout_s}s") from None
        except (ConnectionClosed, OSError) as e:
            if peer is not None:
                peer.fail(f"{type(e).__name__}: {e}")
            raise TransferError(f"transfer {transfer_id} to {addr} failed: {e}") from e
        failed = [d for a in acks for d in a.failed]
        if failed:
            reason = next(a.reason for a in acks if a.failed)
            raise TransferError(f"transfer {transfer_id}: receiver {addr} rejected {len(failed)} of "
                                f"{len(blocks)} blocks {failed[:8]}: {reason}")

    async def close(self) -> None:
        peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.fail("sender closed")
        for peer in peers:
            if peer.reader is not None:
                peer.reader.cancel()
        await asyncio.gather(*(p.reader for p in peers if p.reader is not None), return_exceptions=True)

    # -- internals -------------------------------------------------------------------
    def _slice(self, peer: Peer[ConnT], transfer_id: str, heads: HeadRange,
               layout: KVLayout) -> Slice:
        """The slice ``heads`` as sent on ``peer``; ``TransferError`` unless the receiver
        holds all of those heads (a plan that reached the wrong rank)."""
        theirs = peer.shard
        assert theirs is not None  # _dial checked the Welcome's shard
        if not theirs.heads.contains(heads):
            raise TransferError(f"transfer {transfer_id}: receiver {peer.addr} is {theirs.describe()}; "
                                f"it does not hold KV heads [{heads.start}, {heads.stop}) (the decode "
                                f"ranks' addresses are out of order?)")
        return Slice(heads, layout, layout_id(layout), heads.shift(theirs.heads.start))

    async def _send_frame(self, peer: Peer[ConnT], transfer_id: str, dest: list[int],
                          items: list, part: Slice) -> asyncio.Future[Ack]:
        if peer.broken is not None:
            raise ConnectionClosed(peer.broken)
        sums, payload = self._stage(peer, dest, items, self._pick_corrupt(len(items)), part)
        seq, peer.next_seq = peer.next_seq, peer.next_seq + 1
        fut: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        # Retrieve a failure even when send_blocks gave up before awaiting this frame.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        peer.pending[seq] = fut
        frame = Blocks(seq=seq, transfer_id=transfer_id, layout_id=part.layout_id,
                       dest_block_ids=dest, checksums=sums, heads=part.heads)
        await self._deliver(peer, frame, payload)
        return fut

    def _pick_corrupt(self, n: int) -> list[int]:
        every, first = self.options.corrupt_every, self._blocks_sent
        self._blocks_sent += n
        if every <= 0:
            return []
        return [i for i in range(n) if (first + i) % every == every - 1]

    async def _peer(self, addr: str) -> Peer[ConnT]:
        peer = self._peers.get(addr)
        if peer is not None and peer.broken is None:
            return peer
        lock = self._dialing.setdefault(addr, asyncio.Lock())
        async with lock:
            peer = self._peers.get(addr)
            if peer is not None and peer.broken is None:
                return peer
            peer = await self._dial(addr)
            self._peers[addr] = peer
            return peer

    async def _dial(self, addr: str) -> Peer[ConnT]:
        conn = None
        try:
            async with asyncio.timeout(self.options.connect_timeout_s):
                conn = await self._open(addr)
                hello = self._hello()
                hello.shard = self.shard
                if self.options.cluster_token:
                    hello.token = self.options.cluster_token
                await conn.send(hello)
                reply = await conn.recv()
        except TimeoutError:
            if conn is not None:
                conn.close()
            raise TransferError(f"cannot connect to {addr}: no handshake within "
                                f"{self.options.connect_timeout_s}s") from None
        except (ConnectionClosed, OSError) as e:
            if conn is not None:
                conn.close()
            raise TransferError(f"cannot connect to {addr}: {e}") from e
        if isinstance(reply, Refused):
            conn.close()
            cls = LayoutMismatch if reply.code in ("layout", "tp") else TransferError
            raise cls(f"receiver {addr} refused the handshake: {reply.reason}")
        if not isinstance(reply, Welcome):
            conn.close()
            raise TransferError(f"receiver {addr} answered the handshake with {type(reply).__name__}")
        peer = Peer(addr=addr, conn=conn, welcome=reply, shard=reply.shard)
        try:
            self._check_welcome(addr, reply)
            async with asyncio.timeout(self.options.connect_timeout_s):
                await self._on_welcome(peer)
        except TransferError:
            conn.close()
            raise
        except (TimeoutError, ConnectionClosed, OSError) as e:
            conn.close()
            raise TransferError(f"cannot connect to {addr}: {type(e).__name__}: {e}") from e
        peer.reader = asyncio.create_task(self._read_acks(peer), name=f"kv-acks {addr}")
        return peer

    def _check_welcome(self, addr: str, welcome: Welcome) -> None:
        """Raise ``LayoutMismatch`` unless the receiver's key is compatible with ours (any
        TP whose split is possible) and its layout is its rank's."""
        peer = welcome.shard
        if peer is None:
            raise TransferError(f"receiver {addr} sent no KV shard in its handshake (an older "
                                f"splitserve?); upgrade both nodes")
        problem = self.shard.compat.exchange_problem(peer.compat)
        if problem is None and (why := peer.problem()) is not None:
            problem = why
        if problem is None and peer.layout != welcome.layout:
            problem = f"receiver's cache layout {welcome.layout} is not its {peer.describe()}'s {peer.layout}"
        if problem is not None:
            raise LayoutMismatch(f"KV layout mismatch (this side != peer) with receiver {addr}: {problem}")

    async def _read_acks(self, peer: Peer[ConnT]) -> None:
        try:
            while True:
                msg = await peer.conn.recv()
                if not isinstance(msg, Ack):
                    raise ConnectionClosed(f"protocol error: expected Ack, got {type(msg).__name__}")
                fut = peer.pending.pop(msg.seq, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except asyncio.CancelledError:
            peer.fail("sender closed")
            raise
        except Exception as e:  # any failure ends the connection; the transfers report it
            peer.fail(f"{type(e).__name__}: {e}")


async def _gather(futures: list[asyncio.Future[Ack]]) -> list[Ack]:
    """Await all; raise the first failure only after every future settled (none left unretrieved)."""
    acks = []
    for r in await asyncio.gather(*futures, return_exceptions=True):
        if isinstance(r, BaseException):
            raise r
        acks.append(r)
    return acks


def flip_one_byte(view: memoryview) -> memoryview:
    """A copy of ``view`` with its middle byte inverted (fault injection)."""
    copy = bytearray(view)
    copy[len(copy) // 2] ^= 0xFF
    return memoryview(copy)
