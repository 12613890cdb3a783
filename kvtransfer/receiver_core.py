"""The receiver half of the protocol, over any ``Connection``.

Owns: the server side of the handshake, landing frames (verify each block's
checksum, then write it into the ``KVBlockStore``, or verify in place when the
sender wrote through shared memory), ``on_block`` calls, acknowledgements and
receiver counters. Must not: accept connections itself (a backend subclass
listens and hands each connection to ``_serve``), decide what a failed block means
for its request (the decode node's ``TransferTable`` does), or import the model.

One connection, as ``_serve`` runs it::

    recv Hello --check--> send Welcome        (or send Refused, log, close)
    loop:  recv Blocks header
           recv payload into the connection's staging buffer   (skipped for shm)
           per block: checksum ok? (store.land: on the device for wsum32_v1) -> write -> on_block(ok=True)
                      else                       -> on_block(ok=False, reason)
           send Ack(seq, failed ids)
    a frame cut short (connection lost, receiver stopping) -> on_block(ok=False) for its blocks

Landing runs on the loop between two awaits, so a frame is either fully landed
and reported or not written at all when the receiver stops.

A receiver is one rank's (``KVShard``). The handshake compares the sender's key with
its own (everything but TP must be equal, and both TPs must split the heads) and refuses
a mismatch naming it. A frame may carry a slice of the rank's heads (``Blocks.heads``,
``tp_plan.py``: when the prefill rank holds only some of them); the receiver lands it at
its head offset, and reports a block ``on_block(ok=True)`` once every head it holds has
landed with a good checksum, from however many senders (a bad slice: ``ok=False`` at once)::

    this rank holds heads [4, 8)     frame from P1: heads [4, 6) of block 9 -> lands in cache heads 0..1
                                     frame from P2: heads [6, 8) of block 9 -> lands in 2..3 -> on_block(9, ok)
"""

from __future__ import annotations

import asyncio
import logging
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic

from ..common.auth import token_matches
from ..common.kv_heads import HeadRange
from .base import KVReceiver, OnBlock
from .block_store import KVBlockStore
from .connection import ConnectionClosed, ConnT, format_address
from .layout import KVLayout, KVShard
from .wire import CHECKSUM_ALGOS, PROTOCOL_VERSION, Ack, Blocks, Hello, Refused, Welcome, layout_id

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 256 << 20  # a larger frame is a protocol error (senders default to 2-32 MiB)


@dataclass(slots=True)
class ReceiverStats:
    """Counters for metrics; only ever incremented."""

    connections: int = 0
    refused: int = 0  # handshakes refused (layout, checksum, version, shm)
    frames: int = 0
    blocks_ok: int = 0
    blocks_failed: int = 0
    slices: int = 0  # frames carrying part of this rank's heads (a tensor-parallel plan's)


class FramedReceiver(KVReceiver, Generic[ConnT]):
    """``KVReceiver`` over connections of type ``ConnT``; a backend implements ``_listen`` /
    ``_close_listener`` and may override ``_welcome`` and ``_offers_shm``."""

    scheme: str = ""

    def __init__(self, layout: KVLayout, store: KVBlockStore, on_block: OnBlock,
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 shard: KVShard | None = None, device: object = "cpu"):
        # device: the node's compute device; a backend moving host bytes ignores it (nccl's takes it)
        layout.check_compatible(store.layout)
        self.shard = shard or KVShard.of_layout(layout)
        if (why := self.shard.problem()) is not None or self.shard.layout != layout:
            raise ValueError(f"receiver: shard {self.shard} does not hold a cache of {layout}"
                             + (f": {why}" if why else ""))
        self.layout = layout
        self.store = store
        self.on_block = on_block
        self.host = host
        self.port = port  # the bound port once started
        self.advertise_host = advertise_host or host
        self.stats = ReceiverStats()
        self.last_refusal: str | None = None  # reason of the last refused handshake
        # Set by the owner: False for a transfer id whose blocks must not be written (aborted,
        # failed, unknown), so a late frame never lands in blocks already given to another request.
        self.accepts: Callable[[str], bool] | None = None
        self.cluster_token: str | None = None  # set by the owner: senders must present it
        self._heads = self.shard.heads  # global heads this rank holds
        self._layout_ids: dict[int, int] = {}  # head count -> layout_id of a slice of that many heads
        # dest block -> (transfer_id, bitmask of this rank's local heads landed so far), for
        # blocks that arrive in slices; a block leaves it when complete (reported ok) or failed.
        # Keyed by block: a destination belongs to one live transfer at a time, so a slice of
        # another transfer replaces a dead one's leftovers and the map never outgrows the cache.
        self._parts: dict[int, tuple[str, int]] = {}
        self._serving: dict[asyncio.Task, ConnT] = {}  # serving task -> its connection
        self._stopped = False

    @property
    def address(self) -> str:
        return format_address(self.scheme, self.advertise_host, self.port)

    # -- backend hooks -------------------------------------------------------------
    @abstractmethod
    async def _listen(self) -> None:
        """Bind (setting ``self.port``) and hand each accepted connection to ``_serve``."""

    @abstractmethod
    async def _close_listener(self) -> None:
        """Stop accepting (idempotent)."""

    def _welcome(self, conn: ConnT) -> Welcome:
        """The handshake answer to the sender on ``conn``."""
        return Welcome(layout=self.layout, num_blocks=self.store.num_blocks)

    def _offers_shm(self) -> bool:
        return False

    # -- KVReceiver ------------------------------------------------------------------
    async def start(self) -> None:
        await self._listen()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self._close_listener()
        tasks = list(self._serving)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- one connection --------------------------------------------------------------
    async def _serve(self, conn: ConnT) -> None:
        """Run one connection to its end; never raises (except cancellation)."""
        task = asyncio.current_task()
        assert task is not None  # a connection runs as its own task
        self._serving[task] = conn
        self.stats.connections += 1
        staging = memoryview(b"")  # grows to the largest frame, then is reused (pinned on a GPU)
        try:
            if self._stopped or not await self._handshake(conn):
                return
            while True:
                frame = self._check_frame(await conn.recv())
                payload = None
                if frame.payload_nbytes:
                    if len(staging) < frame.payload_nbytes:
                        staging = self.store.host_buffer(frame.payload_nbytes)
                    payload = staging[:frame.payload_nbytes]
                    try:
                        await conn.recv_payload(payload)
                    except BaseException:
                        self._report_all(frame, "frame cut short: connection lost or receiver stopped")
                        raise
                await self._land_and_ack(conn, frame, payload)
                await asyncio.sleep(0)  # one busy connection must not starve the others
        except ConnectionClosed as e:
            log.debug("connection from %s ended: %s", conn.peer, e)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("connection from %s failed", conn.peer)
        finally:
            conn.close()
            self._serving.pop(task, None)

    async def _handshake(self, conn: ConnT) -> bool:
        hello = await conn.recv()
        if not isinstance(hello, Hello):
            raise ConnectionClosed(f"protocol error: expected Hello, got {type(hello).__name__}")
        refusal = self._check_hello(hello)
        if refusal is None:
            assert hello.shard is not None  # _check_hello refuses a Hello without one
            conn.checksum_algo = hello.checksum  # every frame of this connection is hashed so
            conn.sender_heads = (hello.shard.heads.start, hello.shard.heads.stop)
            welcome = self._welcome(conn)
            welcome.shard = self.shard
            await conn.send(welcome)
            return True
        self.stats.refused += 1
        self.last_refusal = refusal.reason
        log.warning("refused sender %s: %s", conn.peer, refusal.reason)
        await conn.send(refusal)
        return False

    def _check_hello(self, hello: Hello) -> Refused | None:
        if self.cluster_token is not None and not token_matches(hello.token or None, self.cluster_token):
            return Refused("the sender did not present this cluster's token", code="auth")
        if hello.version != PROTOCOL_VERSION:
            return Refused(f"protocol version {hello.version} != receiver's {PROTOCOL_VERSION}",
                           code="version")
        sender = hello.shard
        if sender is None:
            return Refused("the sender sent no KV shard (an older splitserve?); upgrade both nodes",
                           code="version")
        diffs = sender.compat.differences(self.shard.compat)
        if diffs:
            return Refused("KV layout mismatch (sender != receiver): " + "; ".join(diffs), code="layout")
        for side, shard in (("sender", sender), ("receiver", self.shard)):
            if (why := shard.problem()) is not None:
                return Refused(f"no KV transfer plan between prefill tp={sender.compat.tp} and decode "
                               f"tp={self.shard.compat.tp}: {side}: {why}", code="tp")
        if hello.layout != sender.layout:
            return Refused(f"the sender's cache layout {hello.layout} is not its {sender.describe()}'s "
                           f"{sender.layout}", code="layout")
        if hello.checksum not in CHECKSUM_ALGOS:
            return Refused(f"checksum algorithm {hello.checksum!r} is not one of the receiver's "
                           f"{', '.join(CHECKSUM_ALGOS)}", code="checksum")
        if hello.want_shm and not self._offers_shm():
            return Refused(f"receiver {self.address} has no shared-memory cache; use its "
                           f"{self.scheme} backend", code="shm")
        return None

    def _frame_heads(self, frame: Blocks) -> HeadRange:
        return self._heads if frame.heads is None else HeadRange(*frame.heads)

    def _check_frame(self, frame) -> Blocks:
        if not isinstance(frame, Blocks):
            raise ConnectionClosed(f"protocol error: expected Blocks, got {type(frame).__name__}")
        n = len(frame.dest_block_ids)
        count = self._frame_heads(frame).size
        expected = n * self.layout.with_heads(max(count, 1)).block_nbytes
        if len(frame.checksums) != n or frame.payload_nbytes not in (0, expected) \
                or expected > MAX_FRAME_BYTES or count < 1:
            raise ConnectionClosed(f"protocol error: bad frame {frame.seq} of {frame.transfer_id} "
                                f"({n} ids, {len(frame.checksums)} sums, {frame.payload_nbytes} bytes)")
        return frame

    async def _land_and_ack(self, conn: ConnT, frame: Blocks, payload: memoryview | None) -> None:
        """Verify and write the frame (on the loop: measured faster than a lander thread on a
        2-core host, where the thread only adds hand-offs), report each block, then ack."""
        heads = self._frame_heads(frame)
        local = heads.shift(self._heads.start)  # where the slice sits in this rank's cache
        problem = self._slice_problem(conn, frame, heads)
        if payload is not None:
            results = self._land_inline(frame, payload, conn.checksum_algo, local, problem)
        elif self._offers_shm():
            results = self._land_in_place(frame, conn.checksum_algo, local, problem)
        else:
            results = [(d, "frame carries no payload (shm frame sent to a non-shm receiver)")
                       for d in frame.dest_block_ids]
        if local.size != self._heads.size:
            self.stats.slices += 1
        for dest, reason in results:
            self._report(frame.transfer_id, dest, reason, local)
        self.stats.frames += 1
        failed = [d for d, reason in results if reason is not None]
        first = next((r for _, r in results if r is not None), None)
        await conn.send(Ack(seq=frame.seq, failed=failed, reason=first))

    def _slice_problem(self, conn: ConnT, frame: Blocks, heads: HeadRange) -> str | None:
        """Why the frame's slice cannot land here (None: it can): heads this rank does not
        hold, heads the sender does not hold, or a layout other than the slice's."""
        mine = self._heads
        if not mine.contains(heads):
            return (f"frame carries KV heads [{heads.start}, {heads.stop}); this receiver is "
                    f"{self.shard.describe()}")
        theirs = conn.sender_heads
        if theirs is not None and not HeadRange(*theirs).contains(heads):
            return (f"frame carries KV heads [{heads.start}, {heads.stop}) the sender does not hold "
                    f"(it holds [{theirs[0]}, {theirs[1]}))")
        expected = self._layout_ids.get(heads.size)
        if expected is None:
            expected = self._layout_ids[heads.size] = layout_id(self.layout.with_heads(heads.size))
        if frame.layout_id != expected:
            return "frame layout id differs from the handshake's layout (of a slice of its heads)"
        return None

    def _precheck(self, frame: Blocks, dest: int, problem: str | None) -> str | None:
        if self.accepts is not None and not self.accepts(frame.transfer_id):
            return f"transfer {frame.transfer_id} does not take blocks (aborted, failed or unknown)"
        if problem is not None:
            return problem
        if not 0 <= dest < self.store.num_blocks:
            return f"destination block {dest} out of range [0, {self.store.num_blocks})"
        return None

    def _land_inline(self, frame: Blocks, payload: memoryview, algo: str, local: HeadRange,
                     problem: str | None) -> list[tuple[int, str | None]]:
        """Verify each block (slice ``local`` of this cache) in the staging buffer (``algo``:
        on the store's device for wsum32_v1), write the good ones; (dest, reason|None)."""
        reasons = [self._precheck(frame, dest, problem) for dest in frame.dest_block_ids]
        dests = [d if r is None else None for d, r in zip(frame.dest_block_ids, reasons)]
        if all(d is None for d in dests):  # nothing lands (the slice may not even fit this cache)
            return list(zip(frame.dest_block_ids, reasons))
        ok = self.store.land(dests, payload, frame.checksums, algo, local)
        return [(dest, None if good else reason or
                 f"checksum mismatch on block {dest}: payload corrupted in transit")
                for dest, reason, good in zip(frame.dest_block_ids, reasons, ok)]

    def _land_in_place(self, frame: Blocks, algo: str, local: HeadRange,
                       problem: str | None) -> list[tuple[int, str | None]]:
        """The sender already wrote the blocks (slice ``local``) into our shared cache: verify
        them where they are."""
        reasons = {d: self._precheck(frame, d, problem) for d in frame.dest_block_ids}
        good = [d for d in frame.dest_block_ids if reasons[d] is None]
        actual = dict(zip(good, self.store.checksums(good, algo, local)))
        out = []
        for dest, expected in zip(frame.dest_block_ids, frame.checksums):
            reason = reasons[dest]
            if reason is None and actual[dest] != expected:
                reason = (f"checksum mismatch on block {dest}: shared-memory block differs from "
                          f"what the sender hashed")
            out.append((dest, reason))
        return out

    def _report_all(self, frame: Blocks, reason: str) -> None:
        for dest in frame.dest_block_ids:
            self._report(frame.transfer_id, dest, reason)

    def _report(self, transfer_id: str, dest: int, reason: str | None, local: HeadRange | None = None) -> None:
        """Report a block, or record one slice of it and report it once all its heads landed."""
        if reason is None and local is not None and local.size != self._heads.size:
            owner, mask = self._parts.get(dest, (transfer_id, 0))
            mask = (mask if owner == transfer_id else 0) | ((1 << local.stop) - (1 << local.start))
            if mask != (1 << self._heads.size) - 1:
                self._parts[dest] = (transfer_id, mask)
                return
        if dest in self._parts and self._parts[dest][0] == transfer_id:
            del self._parts[dest]
        self._emit(transfer_id, dest, reason)

    def _emit(self, transfer_id: str, dest: int, reason: str | None) -> None:
        if reason is None:
            self.stats.blocks_ok += 1
        else:
            self.stats.blocks_failed += 1
        try:
            self.on_block(transfer_id, dest, reason is None, reason)
        except Exception:  # a faulty callback must not kill the connection
            log.exception("on_block callback failed for %s block %d", transfer_id, dest)
