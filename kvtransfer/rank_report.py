"""What the ranks of a tensor-parallel node tell each other about transfers.

Owns the messages between a node's rank 0 (which owns the transfer bookkeeping) and its
worker ranks (each with its own sender or receiver over its own KV shard), and the two
helpers a decode worker rank runs: ``RankReporter`` (its receiver's ``on_block``: batches
reports into ``RankBlocks``) and ``ClosedTransfers`` (its receiver's ``accepts``: refuses
blocks of transfers rank 0 closed). Must not: carry the messages (the node's rank pipe
does, msgpack via ``encode`` / ``decode``; ``KVExport`` rides the step channel as a
Control payload, ``encode_export`` / ``decode_export``), or touch tensors or the table.

Both roles: a worker says ``RankReady`` once its sender or receiver runs (a decode rank
with its receiver's address: rank 0 names every rank's in ``PrefillRequest.kv_addrs``).

A prefill node (rank 0 decides what every rank sends, in the step order)::

    rank 0 (engine thread, the step that completed blocks)   worker rank r
    Control("kv_export", KVExport(request, transfer,        after that step's forward, before the
            decode addrs, src ids, dest ids))  -- step -->   next: pack its slices (ShardSender.pack),
                                                             then send them (its event loop)
                        <-- RankSent(r, request, transfer, blocks, error) -- once sent (or failed)
    rank 0 answers PrefillResult once its own sends are done and every worker's RankSent
    counted every block (a worker's error fails the request: 502, the decode node falls back)

A decode node::

    worker rank s                                              rank 0
    receiver.on_block = reporter.on_block   -- RankBlocks(s, transfer, landed, failed) -->
                                                               table.on_rank_blocks(msg): counts the
                                                               blocks per (block, decode rank); the
                                                               transfer completes when every rank has
                                                               every block (and the prefill answer came)
    receiver.accepts = closed.accepts       <-- TransfersClosed(seq, ids) ---------------
                                            -- ClosedApplied(s, seq) ------------------>  TransferTable(on_closed=...)
                                                                                          says which; rank 0 reuses
                                                                                          their blocks only after
                                                                                          every worker applied it

Why the acknowledgement: a worker lands frames on its own loop. Once ``TransfersClosed``
is applied there, no later frame of those transfers is written; a frame landing before
it is done before the ``ClosedApplied`` goes out (same loop). So blocks a failed or
aborted transfer held are free for another request on every rank only after all
acknowledgements (the single-rank node gets this for free: one loop lands and frees).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable

import msgspec


class RankReady(msgspec.Struct, tag="rank_ready", omit_defaults=True, kw_only=True):
    """worker rank -> rank 0, once: its KV sender or receiver runs (``kv_addr``: a decode
    rank's receiver address; "" on a prefill rank)."""

    rank: int
    kv_addr: str = ""


class RankSent(msgspec.Struct, tag="rank_sent", omit_defaults=True, kw_only=True):
    """prefill worker rank -> rank 0: its share of one ``KVExport`` is sent (every frame
    acknowledged by the decode ranks) or failed (``error``). ``blocks``: the export's
    block count (an idle replica sends nothing and still reports them)."""

    rank: int
    request_id: str
    transfer_id: str
    blocks: int
    nbytes: int = 0
    error: str | None = None


class KVExport(msgspec.Struct, tag="kv_export", omit_defaults=True, kw_only=True):
    """prefill rank 0 -> worker ranks (a Control, ordered with the steps): pack your heads of
    ``src_ids`` now (this step completed them) and send them into ``dest_ids`` of the decode
    ranks at ``addrs`` (one per decode rank, in rank order) for ``transfer_id`` (the
    export of ``request_id``)."""

    request_id: str
    transfer_id: str
    addrs: list[str]
    src_ids: list[int]
    dest_ids: list[int]


class RankBlocks(msgspec.Struct, tag="rank_blocks", omit_defaults=True, kw_only=True):
    """worker rank -> rank 0: what this rank's receiver reported for one transfer since the
    last message: blocks whose every KV head of this rank landed with a good checksum, and
    blocks it rejected (bad checksum, bad slice, frame cut short, transfer closed)."""

    rank: int
    transfer_id: str
    landed: list[int] = []  # destination block ids
    failed: list[int] = []  # destination block ids
    reason: str | None = None  # why, for the first failed block


class TransfersClosed(msgspec.Struct, tag="transfers_closed", omit_defaults=True, kw_only=True):
    """rank 0 -> worker ranks: these transfers take no more blocks (complete, failed, aborted)."""

    seq: int  # rank 0's counter; the acknowledgement names it
    transfer_ids: list[str]


class ClosedApplied(msgspec.Struct, tag="closed_applied", omit_defaults=True, kw_only=True):
    """worker rank -> rank 0: ``TransfersClosed(seq)`` applied; no later block of them lands here."""

    rank: int
    seq: int


RankMessage = RankReady | RankSent | RankBlocks | TransfersClosed | ClosedApplied

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(RankMessage)
_EXPORT_DECODER = msgspec.msgpack.Decoder(KVExport)


def encode(msg: RankMessage) -> bytes:
    return _ENCODER.encode(msg)


def decode(data: bytes) -> RankMessage:
    """Inverse of ``encode``; raises msgspec.DecodeError / ValidationError on a bad message."""
    return _DECODER.decode(data)


def encode_export(msg: KVExport) -> bytes:
    return _ENCODER.encode(msg)


def decode_export(data: bytes) -> KVExport:
    return _EXPORT_DECODER.decode(data)


class RankReporter:
    """A worker rank's ``on_block``: collects the receiver's reports and hands ``send`` one
    ``RankBlocks`` per transfer per loop turn (a frame's blocks are reported together, so
    that is about one message per frame). Create and use it on the receiver's loop."""

    def __init__(self, rank: int, send: Callable[[RankBlocks], None]):
        self.rank = rank
        self._send = send
        self._pending: dict[str, RankBlocks] = {}  # transfer_id -> its report being gathered
        self._scheduled = False
        self.sent = 0  # messages handed to send

    def on_block(self, transfer_id: str, dest_block_id: int, ok: bool, reason: str | None) -> None:
        """The receiver's ``OnBlock``."""
        report = self._pending.get(transfer_id)
        if report is None:
            report = self._pending[transfer_id] = RankBlocks(rank=self.rank, transfer_id=transfer_id)
        if ok:
            report.landed.append(dest_block_id)
        else:
            report.failed.append(dest_block_id)
            if report.reason is None:
                report.reason = reason
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what was gathered now (also runs by itself once per loop turn)."""
        self._scheduled = False
        pending, self._pending = self._pending, {}
        for report in pending.values():
            self.sent += 1
            self._send(report)


class ClosedTransfers:
    """A worker rank's ``accepts``: every transfer but those rank 0 closed (the last ``keep``
    of them are remembered: a frame older than that many closes is long gone)."""

    def __init__(self, rank: int, keep: int = 65536):
        self.rank = rank
        self.keep = keep
        self._closed: OrderedDict[str, None] = OrderedDict()

    def accepts(self, transfer_id: str) -> bool:
        return transfer_id not in self._closed

    def apply(self, msg: TransfersClosed) -> ClosedApplied:
        """Refuse ``msg``'s transfers from now on; the acknowledgement to send rank 0."""
        for tid in msg.transfer_ids:
            self._closed[tid] = None
            self._closed.move_to_end(tid)
        while len(self._closed) > self.keep:
            self._closed.popitem(last=False)
        return ClosedApplied(rank=self.rank, seq=msg.seq)
