"""Recent prefill work per node, the same in every router replica: the input of
cache_aware's balance term (`RecentWork`, router/routing/recent_work.py).

    a decision on this router      RecentWork.add at once (the policy), and queued here
    the flush task, woken by it    one PUBLISH of everything queued meanwhile (node_id,
                                   work, wall time) on WORK_CHANNEL, tagged with this
                                   router's id: at once when idle, batched under load
    every router's listener        adds the other routers' entries at their time (its
                                   own echo is skipped)

Each replica's RecentWork is then everyone's recent work, up to the pub/sub delay,
which its settle time (``balance_settle_s``, on once another router is heard) waits
out, so replicas weigh a node's share of the work alike and make the same choice for
the same prompt. Redis unreachable (or a message lost): a router counts
what it hears, at worst only its own decisions, the balance term from its share of
the traffic; decisions never wait on Redis.

Owns the pub/sub channel, its wire type and the flush and listener tasks. Must not create
its Redis client (the app's `KVIndex` lends its pool) or make a decision wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import msgspec

from ...common.kv_index import REDIS_ERRORS, KVIndex
from .recent_work import RecentWork

log = logging.getLogger(__name__)
STOP_WAIT_S = 1.0  # how long stop() waits for its cancelled tasks

WORK_CHANNEL = "splitserve:routedwork"


class RoutedWork(msgspec.Struct, tag=True, array_like=True):
    """One router's decisions since its last flush."""
    router_id: str
    items: list[tuple[str, float, float]]  # (prefill node_id, work in token-equivalents, time.time())


@dataclass(slots=True)
class SharedWork:
    index: KVIndex
    recent: RecentWork  # this router's policy's (RoutingPolicy.recent)
    retry_s: float = 1.0
    router_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    received: int = 0  # entries applied from other routers
    _queue: list[tuple[str, float, float]] = field(default_factory=list)
    _queued: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def record(self, node_id: str, work: float, at: float) -> None:
        """A decision of this router sent ``work`` to ``node_id`` at monotonic time ``at``
        (already in `recent`); shared with its wall time, the one the others settle it by."""
        self._queue.append((node_id, work, time.time() - (time.monotonic() - at)))
        self._queued.set()

    def start(self) -> None:
        self.recent.listener = self.record
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._flush(), name="shared-work-flush"),
                       loop.create_task(self._listen(), name="shared-work-listen")]

    async def stop(self) -> None:
        self.recent.listener = None
        for t in self._tasks:
            t.cancel()
        if self._tasks:  # a listener stuck on a half-open connection (e.g. plain text to a TLS
            # port, a wrong password mid-handshake) must not hold up the router's shutdown
            await asyncio.wait(self._tasks, timeout=STOP_WAIT_S)
        self._tasks = []

    async def _flush(self) -> None:
        enc = msgspec.msgpack.Encoder()
        while True:
            await self._queued.wait()
            self._queued.clear()
            batch, self._queue = self._queue, []
            try:
                await self.index.publish(WORK_CHANNEL, enc.encode(RoutedWork(self.router_id, batch)))
            except REDIS_ERRORS as e:  # the others miss this batch; our own view has it
                log.debug("router: recent work not shared (%r)", e)

    async def _listen(self) -> None:
        dec = msgspec.msgpack.Decoder(RoutedWork)
        while True:
            pubsub = self.index.pubsub()
            try:
                await pubsub.subscribe(WORK_CHANNEL)
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=self.retry_s)
                    if msg is None or msg.get("type") != "message":
                        continue
                    try:
                        work = dec.decode(msg["data"])
                    except msgspec.ValidationError:
                        continue
                    if work.router_id != self.router_id:
                        self._apply(work.items)
            except REDIS_ERRORS as e:
                log.debug("router: shared recent work unavailable (%r); retrying", e)
            finally:
                try:
                    await asyncio.shield(pubsub.aclose())
                except REDIS_ERRORS:
                    pass
            await asyncio.sleep(self.retry_s)

    def _apply(self, items: list[tuple[str, float, float]]) -> None:
        self.recent.replicas = True  # from now on, work counts once every replica has heard it
        mono, wall = time.monotonic(), time.time()
        for node_id, work, at in items:
            self.recent.merge(node_id, work, mono - max(0.0, wall - at))
        self.received += len(items)
