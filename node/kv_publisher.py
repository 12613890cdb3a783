"""KVEventPublisher: keeps a node's entries in the Redis prefix index (see
common/kv_index.py) equal to what its prefix cache holds, tagged with the node's id
and epoch.

    engine thread --on_kv(events | snapshot)--> pending IndexDelta (event loop)
                  (events carry each stored block's tier, a snapshot each held hash's:
                  the index keeps the fastest tier holding each, common/kv_index.py)
    publisher task: every flush_interval_s, if pending: KVIndex.apply(pending, seq+1)
                    every refresh_interval_s when idle: KVIndex.refresh (TTL)
                    not in sync (start, Redis error, refused batch, lost keys):
                    request_snapshot() -> a full write, then deltas again

Owns the batch sequence number and the in-sync state. Must not touch the engine
(the snapshot comes through ``request_snapshot`` and ``on_kv``) or let a Redis
outage reach a request: errors are logged once per outage, counted, and end in a
full rewrite once Redis answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import Counter

from ..common.kv_events import KVEvent, Tier
from ..common.kv_index import REDIS_ERRORS, IndexDelta, KVIndex
from ..common.model_metrics import BoundLabels
from ..common.outcomes import IndexBatchResult

log = logging.getLogger(__name__)


@dataclass(slots=True)
class KVEventPublisher:
    """Use from the event loop::

        pub = KVEventPublisher(index, node_id, epoch, engine_thread.request_kv_snapshot, batches)
        pub.start()     # the EngineThread's on_kv_events must call pub.on_kv
        ...
        await pub.stop()  # drops the node's entries
    """

    index: KVIndex
    node_id: str
    epoch: str
    request_snapshot: Callable[[], None]  # makes the engine call on_kv([], hashes) soon
    batches: BoundLabels[Counter]  # labels result: ok | refused | error (one per write attempt)
    flush_interval_s: float = 0.02  # events of this long go out as one batch
    refresh_interval_s: float = 2.0  # TTL refresh when idle; keep well below index.ttl_s
    seq: int = 0  # the last batch seq written
    in_sync: bool = False  # Redis holds our state as of batch `seq`
    snapshots: int = 0  # full writes requested (the first one included)
    _pending: IndexDelta = field(default_factory=IndexDelta)
    _snapshot_asked: bool = False
    _failing: bool = False  # in an outage (logged once)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task | None = None

    def on_kv(self, events: list[KVEvent], snapshot: Sequence[int] | Mapping[int, Tier] | None) -> None:
        """From the engine, in engine order: events since the last call, or (with
        ``snapshot``) every hash held now, which replaces anything pending: hash ->
        the fastest tier holding it, or a plain list of hashes (all on the device)."""
        if snapshot is not None:
            self._pending = IndexDelta.full(snapshot)
            self._snapshot_asked = False
        self._pending.fold(events)
        if self._pending:
            self._wake.set()

    def start(self) -> None:
        assert self._task is None, "KVEventPublisher.start called twice"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-publisher")

    async def _run(self) -> None:
        last_write = 0.0
        while True:
            if not self.in_sync and not self._snapshot_asked:
                self._snapshot_asked = True
                self.snapshots += 1
                self.request_snapshot()
            # Out of sync, only a full delta may go out; wait for the snapshot.
            ready = bool(self._pending) and (self.in_sync or self._pending.clear)
            idle_for = time.monotonic() - last_write
            if not ready and idle_for < self.refresh_interval_s:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.refresh_interval_s - idle_for)
                except TimeoutError:
                    pass
                continue
            if ready:
                delta, self._pending = self._pending, IndexDelta()
                await self._write(delta)
            else:
                await self._refresh()
            last_write = time.monotonic()
            if self._failing:  # Redis is down: each retry costs the engine a snapshot
                await asyncio.sleep(min(1.0, self.refresh_interval_s))
            await asyncio.sleep(self.flush_interval_s)  # let the next batch gather

    async def _write(self, delta: IndexDelta) -> None:
        self.seq += 1
        try:
            applied = await self.index.apply(self.node_id, self.epoch, delta, self.seq)
        except REDIS_ERRORS as e:
            self._outage(e)
            return
        self._recovered()
        if applied:
            self.batches.labels(IndexBatchResult.OK).inc()
            self.in_sync = True
            return
        # Redis lost our keys (restart, expiry) or a batch went missing: start over.
        self.batches.labels(IndexBatchResult.REFUSED).inc()
        log.info("kv index: batch %d of node %s refused (Redis lost earlier batches); "
                 "rewriting the full state", self.seq, self.node_id)
        self.in_sync = False

    async def _refresh(self) -> None:
        try:
            alive = await self.index.refresh(self.node_id, self.epoch)
        except REDIS_ERRORS as e:
            self._outage(e)
            return
        self._recovered()
        if not alive and self.in_sync:
            log.info("kv index: entries of node %s are gone from Redis; rewriting", self.node_id)
            self.in_sync = False

    def _outage(self, e: BaseException) -> None:
        self.batches.labels(IndexBatchResult.ERROR).inc()
        self.in_sync = False  # whatever we failed to write is covered by the next snapshot
        if not self._failing:
            self._failing = True
            log.warning("kv index: publishing for node %s failed (Redis unreachable?); routing "
                        "will not see this node's cache until it is back: %r", self.node_id, e)

    def _recovered(self) -> None:
        if self._failing:
            self._failing = False
            log.info("kv index: Redis reachable again; node %s resyncs its entries", self.node_id)

    async def stop(self, drop: bool = True) -> None:
        """Stop publishing; with ``drop``, delete the node's entries now instead of
        after the TTL (errors logged, not raised)."""
        if self._task is not None:
            while not self._task.done():  # again until it ends: 3.11's wait_for may swallow a cancel
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=0.5)
            self._task = None
        if drop:
            try:
                await self.index.drop(self.node_id, self.epoch)
            except REDIS_ERRORS as e:
                log.warning("kv index: dropping the entries of node %s failed: %r", self.node_id, e)
