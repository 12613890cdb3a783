"""The per-transfer state machine of the decode node.

Owns: ``TransferState``, ``Transfer`` (one KV transfer, with the one future its
driver awaits) and ``TransferTable`` (transfer_id -> Transfer), with leases,
counters for metrics and the snapshot the decode node serves at
``GET /debug/transfers``. Must not: touch tensors or sockets, or free blocks itself:
the decode node frees a transfer's blocks when it leaves the table failed or
aborted, and hands them to the request when it is owned.

::

    reserve --> RESERVED --first block--> TRANSFERRING --every block ok + prefilled(result)--> COMPLETE
                   |                          |                                                 |
                   |  fail(): a block not ok, lease expired, peer error, no answer      own(): request admitted
                   +--------------------------+--------> FAILED                                 v
                   |  abort(): client gone, request cancelled                                 OWNED
                   +--------------------------+--------> ABORTED     (COMPLETE may fail or abort too)

Each transfer's ``done`` future is resolved exactly once, by the table, at the one
transition out of RESERVED / TRANSFERRING, whichever path takes it there:

    the last block lands after the prefill result, or the result after the last block
                                                    -> done = the PrefillResult  (COMPLETE)
    a block not ok or not reserved, the prefill call failed, the lease expired
                                                    -> done = TransferFailure(FAILED, reason)
    abort(): the request was cancelled              -> done = TransferFailure(ABORTED, reason)

A prefix pull (node/kv_pull.py) is a transfer too, into the puller's blocks, answered by the
holder's ``PullResult`` instead of a ``PrefillResult``: the holder sends the leading run of the
blocks it still holds, so the answer cuts the transfer's destination to its first
``num_blocks`` (the rest will not come) before the same rule completes it.

Later changes (COMPLETE -> FAILED when admission fails, OWNED) do not touch it. The
driver of the request awaits ``done`` (shielded: its own cancellation must not cancel
the future) and reads nothing else. ``resolutions`` counts every resolution: it
equals ``reserved`` once every transfer ended, which tests check from outside.

With tensor parallelism (``TransferTable(ranks=N)``, the decode node's TP) every decode
rank lands its own KV heads of every block, and the table counts reports per (block,
decode rank): rank 0's receiver calls ``on_block`` (rank 0), each worker rank's reports
reach rank 0 as ``RankBlocks`` (``rank_report.py``) for ``on_rank_blocks``. A block has
landed when every rank reported it; a block not ok on any rank fails the transfer::

    ranks_landed[block] = bitmask of decode ranks that landed it  --all N bits--> landed.add(block)

The lease renews with every block that lands, so a long prompt whose blocks keep
coming is never cut off, while a sender that stops (dead, partitioned, stuck) lets it
expire ``lease_s`` after its last block (``expire_leases``).

``fail`` and ``abort`` are idempotent: on a transfer already FAILED or ABORTED they
change nothing, and ``abort`` of an OWNED transfer is a no-op (the request now
holds its blocks; cancelling it is the scheduler's job). Every other illegal
transition is a broken invariant and asserts. Late or stray reports (``on_block`` or
``prefilled`` for an unknown id or a transfer that no longer takes them) are counted,
never raised.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..common.protocol import PrefillResult, PullResult
from .rank_report import RankBlocks


class TransferState(enum.Enum):
    RESERVED = "reserved"  # destination blocks held, no block landed yet
    TRANSFERRING = "transferring"  # some blocks landed
    COMPLETE = "complete"  # every block landed with a valid checksum and the prefill node answered
    OWNED = "owned"  # the request was admitted; its blocks belong to the scheduler
    FAILED = "failed"  # terminal: the decode node frees the blocks and prefills locally
    ABORTED = "aborted"  # terminal: cancelled; the decode node frees the blocks


LIVE = (TransferState.RESERVED, TransferState.TRANSFERRING)  # may still receive blocks
TERMINAL = (TransferState.OWNED, TransferState.FAILED, TransferState.ABORTED)


class TransferFailure(NamedTuple):
    """What ``Transfer.done`` holds when the transfer ended without its KV."""
    state: TransferState  # FAILED or ABORTED
    reason: str


TransferAnswer = PrefillResult | PullResult  # the sending node's answer
TransferOutcome = TransferAnswer | TransferFailure


@dataclass(slots=True)
class Transfer:
    transfer_id: str
    request_id: str
    dest_block_ids: tuple[int, ...]  # the decode node's blocks reserved for this transfer
    created: float  # clock() at reserve
    lease_s: float  # the lease, renewed to now + lease_s by every block that lands
    lease_deadline: float  # clock() after which a transfer not yet complete has expired
    done: asyncio.Future[TransferOutcome]  # resolved once, by the table, when it leaves LIVE
    state: TransferState = TransferState.RESERVED
    landed: set[int] = field(default_factory=set)  # dest ids reported ok by every decode rank
    # dest id -> bitmask of the decode ranks that reported it ok, while some have not (TP > 1)
    ranks_landed: dict[int, int] = field(default_factory=dict)
    result: TransferAnswer | None = None  # the sender's answer (a prefill node's: the first token), once it came
    reason: str | None = None  # why it failed or was aborted

    @property
    def all_landed(self) -> bool:
        return self.landed.issuperset(self.dest_block_ids)


class TransferTable:
    """All transfers of one decode node. Single-threaded: call it from the node's loop.
    ``clock``: seconds, monotonic (injectable so lease tests need no sleeping);
    ``loop``: where the ``done`` futures live (default: the running loop at ``reserve``);
    ``ranks``: the node's tensor-parallel ranks, each of which must land every block;
    ``on_closed``: called with a transfer id when it stops taking blocks (rank 0 tells its
    worker ranks, ``rank_report.TransfersClosed``); ``on_removed``: with a transfer id when
    its owner removes it (whatever it kept about the transfer goes with it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 loop: asyncio.AbstractEventLoop | None = None, ranks: int = 1,
                 on_closed: Callable[[str], None] | None = None,
                 on_removed: Callable[[str], None] | None = None):
        assert ranks >= 1, f"ranks must be >= 1, got {ranks}"
        self._clock = clock
        self._loop = loop
        self.ranks = ranks
        self._all_ranks = (1 << ranks) - 1
        self._on_closed = on_closed
        self._on_removed = on_removed
        self._transfers: dict[str, Transfer] = {}  # transfer_id -> Transfer
        self.ignored_reports = 0  # on_block / prefilled for unknown / no longer live transfers
        self.stray_blocks = 0  # blocks reported for a destination the transfer never reserved
        self.reserved = 0  # transfers ever reserved
        # done futures resolved, by outcome: prefilled (COMPLETE), failed, aborted
        self.resolutions = {"prefilled": 0, "failed": 0, "aborted": 0}

    def __len__(self) -> int:
        return len(self._transfers)

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._transfers

    def get(self, transfer_id: str) -> Transfer | None:
        return self._transfers.get(transfer_id)

    def reserve(self, transfer_id: str, request_id: str, dest_block_ids: Iterable[int],
                lease_s: float) -> Transfer:
        """A new transfer into ``dest_block_ids`` (blocks the engine reserved), RESERVED."""
        assert transfer_id not in self._transfers, f"transfer {transfer_id} already exists"
        loop = self._loop or asyncio.get_running_loop()
        now = self._clock()
        transfer = Transfer(transfer_id=transfer_id, request_id=request_id,
                            dest_block_ids=tuple(dest_block_ids), created=now, lease_s=lease_s,
                            lease_deadline=now + lease_s, done=loop.create_future())
        self._transfers[transfer_id] = transfer
        self.reserved += 1
        return transfer

    def _live(self, transfer_id: str) -> Transfer | None:
        transfer = self._transfers.get(transfer_id)
        if transfer is None or transfer.state not in LIVE:
            self.ignored_reports += 1
            return None
        return transfer

    def on_block(self, transfer_id: str, dest_block_id: int, ok: bool,
                 reason: str | None = None, rank: int = 0) -> Transfer | None:
        """Record one receiver report of decode rank ``rank``. Returns the transfer, or None
        when the report was ignored (unknown id, or the transfer no longer takes blocks). A
        block not ok, or one this transfer did not reserve, fails the transfer; the block
        that lands last on its last rank completes it when the prefill node already answered."""
        assert 0 <= rank < self.ranks, f"a report of rank {rank} on a {self.ranks}-rank node"
        transfer = self._live(transfer_id)
        if transfer is None:
            return None
        transfer.state = TransferState.TRANSFERRING
        if dest_block_id not in transfer.dest_block_ids:
            self.stray_blocks += 1
            self.fail(transfer_id, f"block {dest_block_id} was not reserved for this transfer")
        elif not ok:
            where = f" on decode rank {rank}" if self.ranks > 1 else ""
            self.fail(transfer_id, f"block {dest_block_id}{where}: {reason or 'rejected'}")
        else:
            if self.ranks == 1:
                transfer.landed.add(dest_block_id)
            elif dest_block_id not in transfer.landed:
                mask = transfer.ranks_landed.get(dest_block_id, 0) | (1 << rank)
                if mask == self._all_ranks:
                    transfer.ranks_landed.pop(dest_block_id, None)
                    transfer.landed.add(dest_block_id)
                else:
                    transfer.ranks_landed[dest_block_id] = mask
            transfer.lease_deadline = self._clock() + transfer.lease_s
            self._complete_if_ready(transfer)
        return transfer

    def on_rank_blocks(self, report: RankBlocks) -> Transfer | None:
        """Record a worker rank's reports (``rank_report.RankBlocks``): its failures first,
        so a frame with a bad block never completes the transfer; None when ignored."""
        transfer = None
        for dest in report.failed:
            transfer = self.on_block(report.transfer_id, dest, False, report.reason, report.rank)
        for dest in report.landed:
            transfer = self.on_block(report.transfer_id, dest, True, None, report.rank)
        return transfer

    def prefilled(self, transfer_id: str, result: TransferAnswer) -> Transfer | None:
        """Record the sender's answer; completes the transfer when every block landed (a
        ``PullResult`` first cuts the destination to the blocks it says were sent). Ignored
        (None) unless the transfer is live."""
        transfer = self._live(transfer_id)
        if transfer is None:
            return None
        if isinstance(result, PullResult):
            if not 0 <= result.num_blocks <= len(transfer.dest_block_ids):
                self.fail(transfer_id, f"the holder says it sent {result.num_blocks} of "
                                       f"{len(transfer.dest_block_ids)} blocks")
                return transfer
            transfer.dest_block_ids = transfer.dest_block_ids[:result.num_blocks]
        transfer.result = result
        self._complete_if_ready(transfer)
        return transfer

    def _complete_if_ready(self, transfer: Transfer) -> None:
        if transfer.all_landed and transfer.result is not None:
            transfer.state = TransferState.COMPLETE
            self._resolve(transfer, "prefilled", transfer.result)

    def is_live(self, transfer_id: str) -> bool:
        """Whether blocks for this transfer may still be written (reserved or transferring)."""
        transfer = self._transfers.get(transfer_id)
        return transfer is not None and transfer.state in LIVE

    def all_landed(self, transfer_id: str) -> bool:
        transfer = self._transfers.get(transfer_id)
        return transfer is not None and transfer.state in (*LIVE, TransferState.COMPLETE) and transfer.all_landed

    def own(self, transfer_id: str) -> Transfer:
        transfer = self._transfers[transfer_id]
        assert transfer.state is TransferState.COMPLETE, f"own({transfer_id}) from {transfer.state.name}"
        transfer.state = TransferState.OWNED
        return transfer

    def fail(self, transfer_id: str, reason: str) -> Transfer | None:
        """Mark failed (idempotent; unknown id: None)."""
        return self._end(transfer_id, TransferState.FAILED, reason)

    def abort(self, transfer_id: str, reason: str = "aborted") -> Transfer | None:
        """Mark aborted (idempotent; unknown id: None; owned: unchanged)."""
        transfer = self._transfers.get(transfer_id)
        if transfer is not None and transfer.state is TransferState.OWNED:
            return transfer
        return self._end(transfer_id, TransferState.ABORTED, reason)

    def _end(self, transfer_id: str, state: TransferState, reason: str) -> Transfer | None:
        transfer = self._transfers.get(transfer_id)
        if transfer is None or transfer.state in (TransferState.FAILED, TransferState.ABORTED):
            return transfer
        assert transfer.state is not TransferState.OWNED, \
            f"{state.name.lower()}({transfer_id}) of an owned transfer"
        was_live = transfer.state in LIVE
        transfer.state, transfer.reason = state, reason
        if was_live:  # a COMPLETE transfer's done already holds its result
            self._resolve(transfer, state.value, TransferFailure(state, reason))
        return transfer

    def _resolve(self, transfer: Transfer, outcome: str, value: TransferOutcome) -> None:
        """The one place a ``done`` future is resolved (on leaving LIVE, so once)."""
        self.resolutions[outcome] += 1
        assert not transfer.done.done(), f"transfer {transfer.transfer_id} resolved twice"
        transfer.done.set_result(value)
        if self._on_closed is not None:  # it takes no more blocks, on any rank
            self._on_closed(transfer.transfer_id)

    def expired(self, now: float | None = None) -> list[Transfer]:
        """Transfers whose lease passed before they completed."""
        now = self._clock() if now is None else now
        return [t for t in self._transfers.values() if t.state in LIVE and now >= t.lease_deadline]

    def expire_leases(self) -> list[Transfer]:
        """Fail every transfer whose lease passed; returns them."""
        expired = self.expired()
        for t in expired:
            self.fail(t.transfer_id, f"lease expired: no block arrived for {t.lease_s:g}s")
        return expired

    def remove(self, transfer_id: str) -> Transfer | None:
        """Forget a finished transfer (owned, failed or aborted); unknown id: None."""
        transfer = self._transfers.get(transfer_id)
        if transfer is not None:
            assert transfer.state in TERMINAL, \
                f"remove({transfer_id}) while {transfer.state.name}: its blocks would leak"
            del self._transfers[transfer_id]
            if self._on_removed is not None:
                self._on_removed(transfer_id)
        return transfer

    def counts(self) -> dict[str, int]:
        """Number of transfers per state (every state present), for metrics."""
        out = {s.value: 0 for s in TransferState}
        for t in self._transfers.values():
            out[t.state.value] += 1
        return out

    def snapshot(self) -> list[dict]:
        """One JSON-ready dict per transfer, oldest first, for ``/debug/transfers``."""
        now = self._clock()
        out = [{"transfer_id": t.transfer_id, "request_id": t.request_id, "state": t.state.value,
                "blocks": len(t.dest_block_ids), "landed": len(t.landed), "prefilled": t.result is not None,
                "reason": t.reason,
                "age_s": round(now - t.created, 3),
                "lease_left_s": round(t.lease_deadline - now, 3)}
               for t in sorted(self._transfers.values(), key=lambda t: t.created)]
        if self.ranks > 1:  # blocks landed on some decode ranks, not yet on all
            for row, t in zip(out, sorted(self._transfers.values(), key=lambda t: t.created)):
                row["landed_on_some_ranks"] = len(t.ranks_landed)
        return out

    def totals(self) -> dict:
        """Counters since start, for ``/debug/transfers``: every reserved transfer is
        resolved once, so ``reserved == sum(resolutions)`` when none is live."""
        return {"reserved": self.reserved, "ranks": self.ranks, "resolutions": dict(self.resolutions),
                "ignored_reports": self.ignored_reports, "stray_blocks": self.stray_blocks}
