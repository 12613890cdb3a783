"""The prefix mirror's follower: the one task per router that keeps its `PrefixMirror`
(prefix_mirror.py) equal to the prefix index in Redis, following the nodes' index
updates over pub/sub and resyncing a node from its snapshot on a gap or a new epoch.

    nodes --EVALSHA apply (SET, tiers + seq + PUBLISH IndexUpdate, atomic)--> Redis
    Redis --pub/sub splitserve:kvevents--> this follower --> the mirror
        update seq == mirrored seq + 1     apply (SREM, SADD on the node's bit; the
                                           tier of what it holds below the device)
        update with clear                  replace the node (a full write)
        seq older                          ignore (already in a snapshot)
        gap, unknown node or epoch         resync the node: KVIndex.snapshot (one
                                           MULTI: its SET and the seq it is as of)
        a newer epoch of a node id         the old epoch's entries are dropped
    every check_interval_s: KVIndex.published_seqs; a node still behind what Redis
        applied one check ago (a lost last update), or not mirrored at all (a late
        start), is resynced; a node whose keys are gone (expired, dropped) leaves
    Redis unreachable: the mirror empties and lookups say "not looked up" (routing
        by load only) until it reconnects, resubscribes and resyncs every node.

Owns the task, its resync rules and its counters. Must not create its Redis client
(the app's lifespan owns the `KVIndex`) or serve lookups (the mirror does).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

import msgspec

from ...common.kv_events import IndexUpdate
from ...common.kv_index import EVENTS_CHANNEL, REDIS_ERRORS, KVIndex
from .prefix_mirror import NodeKey, PrefixMirror, lower_of

log = logging.getLogger(__name__)

STOP_ATTEMPTS = 20  # cancellations stop() sends, STOP_WAIT_S apart
STOP_WAIT_S = 0.25


@dataclass(slots=True)
class MirrorFollower:
    mirror: PrefixMirror
    index: KVIndex
    check_interval_s: float = 1.0  # catch-up against Redis's seqs, off the request path
    retry_s: float = 1.0  # reconnect delay after Redis failed
    # Fault injection for benchmarks and tests: drop this share of received updates.
    event_loss: float = 0.0
    resyncs: int = 0  # snapshots read (late start, gaps, epochs, lost connection)
    updates: int = 0  # updates received (dropped ones included)
    dropped: int = 0  # updates dropped by ``event_loss``
    _rng: random.Random = field(default_factory=lambda: random.Random(0))
    _task: asyncio.Task | None = None

    def start(self) -> None:
        assert self._task is None, "MirrorFollower.start called twice"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="prefix-mirror")

    async def stop(self) -> None:
        """Cancel the task and wait for it. A cancellation that lands while
        redis-py's pub/sub read is inside its own read timeout can be swallowed (the
        task then waits for the next message forever), so cancel again until it ends."""
        if self._task is None:
            return
        for _ in range(STOP_ATTEMPTS):
            self._task.cancel()
            done, _ = await asyncio.wait({self._task}, timeout=STOP_WAIT_S)
            if done:
                break
        else:
            log.warning("router: the prefix mirror's follower did not stop after %d cancellations",
                        STOP_ATTEMPTS)
        self._task = None

    async def _run(self) -> None:
        down = False
        while True:
            pubsub = self.index.pubsub()
            try:
                await pubsub.subscribe(EVENTS_CHANNEL)
                await _confirmed(pubsub, self.retry_s + 1.0)  # live before the snapshots are read
                await self._catch_up()  # everything published before the subscription
                self.mirror.connected = True
                if down:
                    down = False
                    log.info("router: prefix index reachable again; routing by cache and load")
                await self._follow(pubsub)
            except REDIS_ERRORS as e:
                self.mirror.metrics.redis_errors.labels(op="index_events").inc()
                if not down:
                    down = True
                    log.warning("router: prefix index events unavailable (%r); routing by load "
                                "only, reconnecting every %.1fs", e, self.retry_s)
            finally:
                self.mirror.forget_all()
                await asyncio.shield(_close(pubsub))
            await asyncio.sleep(self.retry_s)

    async def _follow(self, pubsub) -> None:
        next_check = time.monotonic() + self.check_interval_s
        while True:
            wait = max(0.0, next_check - time.monotonic())
            msg = await pubsub.get_message(timeout=wait)
            if msg is not None and msg.get("type") == "message":
                await self._on_update(msg["data"])
            if time.monotonic() >= next_check:
                await self._catch_up()
                next_check = time.monotonic() + self.check_interval_s

    async def _on_update(self, data: bytes) -> None:
        self.updates += 1
        if self.event_loss and self._rng.random() < self.event_loss:
            self.dropped += 1
            return
        try:
            u = msgspec.msgpack.decode(data, type=IndexUpdate)
        except msgspec.ValidationError as e:
            log.warning("router: ignoring a malformed prefix index update: %s", e)
            return
        mirror = self.mirror
        key = (u.node_id, u.epoch)
        if mirror.retired(key):
            return
        entry = mirror.node(key)
        if entry is None:
            mirror.retire_other_epochs(key)
        if u.clear:
            mirror.replace(key, u.seq, {*u.stored, *u.stored_host, *u.stored_disk}, lower_of(u))
        elif entry is not None and u.seq == entry.seq + 1:
            mirror.apply(entry, u)
        elif entry is None or u.seq > entry.seq:  # unknown node, or a gap
            await self._resync(key)

    async def _catch_up(self) -> None:
        mirror = self.mirror
        seqs = await self.index.published_seqs()
        for key in [k for k in mirror.keys() if k not in seqs]:
            mirror.drop(key)  # expired or dropped: the node is gone
        for key, seq in seqs.items():
            if mirror.retired(key):
                continue
            entry = mirror.node(key)
            if entry is None or (entry.behind is not None and entry.seq < entry.behind):
                await self._resync(key)
            else:
                entry.behind = seq if entry.seq < seq else None

    async def _resync(self, key: NodeKey) -> None:
        snap = await self.index.snapshot(*key)
        self.resyncs += 1
        if snap.seq is None:
            self.mirror.drop(key)
        else:
            self.mirror.replace(key, snap.seq, snap.hashes, dict(snap.lower))


async def _confirmed(pubsub, timeout_s: float) -> None:
    """Wait for the subscription's confirmation; TimeoutError after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while True:
            msg = await pubsub.get_message(timeout=timeout_s)
            if msg is not None and msg.get("type") == "subscribe":
                return


async def _close(pubsub) -> None:
    try:
        await pubsub.aclose()
    except REDIS_ERRORS:
        pass
