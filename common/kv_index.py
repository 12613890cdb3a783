"""The global prefix-cache index in Redis: which node (at which epoch) holds which
block hashes, written by the nodes, mirrored in memory by every router.

Owns the Redis layout, the folding of a node's event stream into one write, the
atomic sequence-checked write that also publishes the write to the routers, and
the reads a router needs to (re)build its mirror. Must not: import torch or node
code, decide when to write or what to do when Redis is down (callers do: the node's
publisher resyncs, the router degrades to load-only; every method here raises one
of ``REDIS_ERRORS`` when Redis is unreachable).

Data model: one Redis SET per (node, epoch) of the block hashes that node holds,
plus the sequence number of the last batch written into it, and one channel::

    splitserve:kv:{node_id}:{epoch}     SET  {block hash as unsigned decimal, ...}   PX ttl
    splitserve:kvseq:{node_id}:{epoch}  STR  last applied batch seq                  PX ttl
    splitserve:kvevents                 pub/sub channel of IndexUpdate (msgpack)

- Write (one batch per node per flush interval): ``EVALSHA apply`` = the delta folded
  from the batch's events (clear?, SREM removed, SADD stored), SET seq, PEXPIRE both,
  PUBLISH the delta as ``IndexUpdate(seq)``, atomically; only if the stored seq is
  the batch's predecessor. A missing or other seq (Redis restarted, the keys
  expired, a write was lost) refuses the batch: the node then rewrites its whole
  state (a *full* write: DEL + SADD of every held hash, which needs no predecessor,
  published with ``clear``). One round trip per batch.
- The SET and seq are each node's snapshot: ``snapshot`` reads both in one
  MULTI, so a router that missed an update (a gap in seq, a new epoch, a late
  start, a lost connection) rebuilds that node at exactly batch ``seq`` and applies
  the updates after it. ``published_seqs`` lists every (node, epoch) with its seq in
  a few round trips, for the router's periodic catch-up.
- Refresh (every heartbeat-ish interval): PEXPIRE both keys, pipelined; a node that
  stops refreshing (crash, partition) loses its entries after ``ttl_s``.
- ``AllBlocksCleared`` makes the batch full: the set is deleted first.
- Epochs: a restarted node writes under a new epoch; its old keys just expire, and
  routers drop the old epoch's entries once they see the new one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, IndexUpdate, KVEvent
from .registry import REDIS_ERRORS, make_redis

__all__ = ["KVIndex", "IndexDelta", "NodeSnapshot", "REDIS_ERRORS", "EVENTS_CHANNEL", "blocks_key",
           "seq_key"]

SET_PREFIX = "splitserve:kv:"
SEQ_PREFIX = "splitserve:kvseq:"
EVENTS_CHANNEL = "splitserve:kvevents"
_ARGS_PER_CALL = 1000  # members per SADD / SREM inside the script (Lua's unpack limit is ~8000)

# KEYS[1] set, KEYS[2] seq. ARGV: prev seq ("" = full write, no check), new seq, ttl ms,
# clear "1"|"0", number of removed hashes, members per SADD/SREM, channel, IndexUpdate
# payload, removed..., stored...
# Returns 1 when applied (and published), 0 when the stored seq is not ``prev`` (nothing changed).
_APPLY_LUA = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
if ARGV[4] == '1' then redis.call('DEL', KEYS[1]) end
local chunk = tonumber(ARGV[6])
local first_add = 9 + tonumber(ARGV[5])
local i = 9
while i < first_add do
  local j = math.min(i + chunk - 1, first_add - 1)
  redis.call('SREM', KEYS[1], unpack(ARGV, i, j))
  i = j + 1
end
while i <= #ARGV do
  local j = math.min(i + chunk - 1, #ARGV)
  redis.call('SADD', KEYS[1], unpack(ARGV, i, j))
  i = j + 1
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PUBLISH', ARGV[7], ARGV[8])
return 1
"""


def blocks_key(node_id: str, epoch: str) -> str:
    return f"{SET_PREFIX}{node_id}:{epoch}"


def seq_key(node_id: str, epoch: str) -> str:
    return f"{SEQ_PREFIX}{node_id}:{epoch}"


class NodeSnapshot(NamedTuple):
    seq: int | None  # the last batch applied; None: Redis holds nothing for the node
    hashes: set[int]


@dataclass(slots=True)
class IndexDelta:
    """A node's events since its last write, folded into one set change.

    Per hash the last event wins, and a clear drops everything before it, so applying
    ``clear`` (DEL) then ``removed`` (SREM) then ``stored`` (SADD) leaves the set as
    the events would, in any order within each step. ``stored`` and ``removed`` are
    disjoint. A delta with ``clear`` is *full*: it alone determines the set.
    """

    clear: bool = False
    stored: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)

    @classmethod
    def full(cls, hashes: Iterable[int]) -> IndexDelta:
        """The whole state of a node holding exactly ``hashes``."""
        return cls(clear=True, stored=set(hashes))

    def fold(self, events: Iterable[KVEvent]) -> None:
        """Apply ``events`` (in stream order) on top of this delta."""
        for ev in events:
            if isinstance(ev, BlockStored):
                self.stored.update(ev.block_hashes)
                self.removed.difference_update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.removed.update(ev.block_hashes)
                self.stored.difference_update(ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared), f"unknown KV event {ev!r}"
                self.clear = True
                self.stored.clear()
                self.removed.clear()

    def __bool__(self) -> bool:
        return self.clear or bool(self.stored) or bool(self.removed)


class KVIndex:
    """Reads and writes the prefix index. Owns one Redis client; call `close()`.

    ``ttl_s``: how long a node's entries live without a write or `refresh`.
    """

    def __init__(self, redis_url: str, ttl_s: float = 15.0, timeout_s: float = 1.0):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._redis = make_redis(redis_url, timeout_s)
        self._apply = self._redis.register_script(_APPLY_LUA)

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    # -- node side -----------------------------------------------------------------

    async def apply(self, node_id: str, epoch: str, delta: IndexDelta, seq: int) -> bool:
        """Write ``delta`` as batch ``seq`` of (node_id, epoch), refreshing the TTL.

        A full delta (``clear``) is always applied. Any other delta is applied only
        if batch ``seq - 1`` was the last one applied; otherwise nothing changes and
        False is returned (the caller must write its full state).
        """
        assert seq >= 1, f"batch seq must start at 1, got {seq}"
        prev = "" if delta.clear else str(seq - 1)
        removed = [] if delta.clear else list(delta.removed)
        stored = list(delta.stored)
        update = msgspec.msgpack.encode(IndexUpdate(node_id, epoch, seq, delta.clear, stored, removed))
        args = [prev, str(seq), self._ttl_ms, "1" if delta.clear else "0", len(removed),
                _ARGS_PER_CALL, EVENTS_CHANNEL, update, *map(str, removed), *map(str, stored)]
        keys = [blocks_key(node_id, epoch), seq_key(node_id, epoch)]
        return await self._apply(keys=keys, args=args) == 1

    async def refresh(self, node_id: str, epoch: str) -> bool:
        """Extend the TTL of the node's entries; False if its seq key is gone (Redis
        lost it: the caller must write its full state). One pipelined round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.pexpire(seq_key(node_id, epoch), self._ttl_ms)
            pipe.pexpire(blocks_key(node_id, epoch), self._ttl_ms)
            seq_alive, _ = await pipe.execute()
        return bool(seq_alive)

    async def drop(self, node_id: str, epoch: str) -> None:
        """Delete the node's entries now (a clean shutdown); idempotent."""
        await self._redis.delete(blocks_key(node_id, epoch), seq_key(node_id, epoch))

    # -- router side -----------------------------------------------------------------

    async def publish(self, channel: str, data: bytes) -> None:
        """One PUBLISH on this index's pool (router replicas share their recent work)."""
        await self._redis.publish(channel, data)

    def pubsub(self):
        """A pub/sub client on this index's connection pool (the caller subscribes to
        ``EVENTS_CHANNEL``, reads the confirmation, and closes it)."""
        return self._redis.pubsub()

    async def snapshot(self, node_id: str, epoch: str) -> NodeSnapshot:
        """Everything (node_id, epoch) holds and the seq of the batch it is as of,
        read atomically (one MULTI)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.get(seq_key(node_id, epoch))
            pipe.smembers(blocks_key(node_id, epoch))
            raw_seq, members = await pipe.execute()
        return NodeSnapshot(None if raw_seq is None else int(raw_seq), {int(m) for m in members})

    async def published_seqs(self) -> dict[tuple[str, str], int]:
        """(node_id, epoch) -> last applied seq, for every node in the index (SCAN
        then one MGET)."""
        keys = [k async for k in self._redis.scan_iter(match=SEQ_PREFIX + "*", count=1000)]
        if not keys:
            return {}
        out = {}
        for key, raw in zip(keys, await self._redis.mget(keys)):
            if raw is None:  # expired between SCAN and MGET
                continue
            node_id, _, epoch = key.decode()[len(SEQ_PREFIX):].rpartition(":")
            out[(node_id, epoch)] = int(raw)
        return out

    # -- inspection (tests, debugging) ---------------------------------------------------

    async def members(self, node_id: str, epoch: str) -> set[int]:
        """Every hash held by (node_id, epoch)."""
        return {int(m) for m in await self._redis.smembers(blocks_key(node_id, epoch))}

    async def last_seq(self, node_id: str, epoch: str) -> int | None:
        raw = await self._redis.get(seq_key(node_id, epoch))
        return None if raw is None else int(raw)

    async def close(self) -> None:
        await self._redis.aclose()
