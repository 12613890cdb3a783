"""The global prefix-cache index in Redis: which node (at which epoch) holds which
block hashes, written by the nodes, mirrored in memory by every router.

Owns the Redis layout, the folding of a node's event stream into one write, the
atomic sequence-checked write that also publishes the write to the routers, and
the reads a router needs to (re)build its mirror. Must not: import torch or node
code, decide when to write or what to do when Redis is down (callers do: the node's
publisher resyncs, the router degrades to load-only; every method here raises one
of ``REDIS_ERRORS`` when Redis is unreachable).

Data model: per (node, epoch), one Redis SET of the block hashes that node holds in
any tier, one HASH of those it holds only below the device (host memory, disk; the
value is the fastest tier holding it, `Tier`), the sequence number of the last batch
written into them, and one pub/sub channel::

    splitserve:kv:{node_id}:{epoch}      SET   {block hash as unsigned decimal, ...}   PX ttl
    splitserve:kvtier:{node_id}:{epoch}  HASH  {block hash: tier, ...} (1 host, 2 disk) PX ttl
    splitserve:kvseq:{node_id}:{epoch}   STR   last applied batch seq                  PX ttl
    splitserve:kvevents                  pub/sub channel of IndexUpdate (msgpack)

Why a SET of every held hash beside a HASH of the lower tiers, rather than one HASH of
hash -> tier: whether a block is held at all (what a router's walk reads) stays one SET,
as readers from before tiers know it; a node without lower tiers (every node until it
offloads, and the common case) writes and keeps nothing more than before; a record
without the HASH (a node from before tiers) reads as all on the device with no type
check. The price: a hash held below the device is named in both.

- Write (one batch per node per flush interval): ``EVALSHA apply`` = the delta folded
  from the batch's events (clear?, SREM removed, SADD stored, HDEL removed and
  device-stored ones from the HASH when it exists, HSET host- and disk-stored ones),
  SET seq, PEXPIRE the three, PUBLISH the delta as ``IndexUpdate(seq)``, atomically;
  only if the stored seq is the batch's predecessor. A missing or other seq (Redis
  restarted, the keys expired, a write was lost) refuses the batch: the node then
  rewrites its whole state (a *full* write: DEL + SADD/HSET of every held hash, which
  needs no predecessor, published with ``clear``). One round trip per batch.
- The SET, HASH and seq are each node's snapshot: ``snapshot`` reads them in one
  MULTI, so a router that missed an update (a gap in seq, a new epoch, a late
  start, a lost connection) rebuilds that node at exactly batch ``seq`` and applies
  the updates after it. ``published_seqs`` lists every (node, epoch) with its seq in
  a few round trips, for the router's periodic catch-up.
- Refresh (every heartbeat-ish interval): PEXPIRE the keys, pipelined; a node that
  stops refreshing (crash, partition) loses its entries after ``ttl_s``.
- ``AllBlocksCleared`` makes the batch full: the set and the HASH are deleted first.
- Epochs: a restarted node writes under a new epoch; its old keys just expire, and
  routers drop the old epoch's entries once they see the new one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import msgspec

from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, IndexUpdate, KVEvent, Tier
from .node_registry import REDIS_ERRORS, make_redis

__all__ = ["KVIndex", "IndexDelta", "NodeSnapshot", "REDIS_ERRORS", "EVENTS_CHANNEL", "blocks_key",
           "seq_key", "tiers_key"]

SET_PREFIX = "splitserve:kv:"
TIER_PREFIX = "splitserve:kvtier:"
SEQ_PREFIX = "splitserve:kvseq:"
EVENTS_CHANNEL = "splitserve:kvevents"
# members per SADD / SREM / HDEL (HSET: field-value pairs) inside the script (Lua's unpack
# limit is ~8000)
_ARGS_PER_CALL = 1000

# KEYS[1] set, KEYS[2] seq, KEYS[3] tiers. ARGV: prev seq ("" = full write, no check), new
# seq, ttl ms, clear "1"|"0", number of removed hashes, members per call, channel,
# IndexUpdate payload, number of device-stored hashes, number of host-stored ones, the host
# tier's value, the disk tier's, then removed..., device-stored..., host-stored..., disk-stored...
# Returns 1 when applied (and published), 0 when the stored seq is not ``prev`` (nothing changed).
_APPLY_LUA = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
if ARGV[4] == '1' then redis.call('DEL', KEYS[1], KEYS[3]) end
local chunk = tonumber(ARGV[6])
local function each(cmd, key, from, to, tier)
  local i = from
  while i <= to do
    local j = math.min(i + chunk - 1, to)
    if tier then
      local args = {}
      for k = i, j do
        args[#args + 1] = ARGV[k]
        args[#args + 1] = tier
      end
      redis.call(cmd, key, unpack(args))
    else
      redis.call(cmd, key, unpack(ARGV, i, j))
    end
    i = j + 1
  end
end
local removed_end = 12 + tonumber(ARGV[5])
local device_end = removed_end + tonumber(ARGV[9])
local host_end = device_end + tonumber(ARGV[10])
each('SREM', KEYS[1], 13, removed_end)
if redis.call('EXISTS', KEYS[3]) == 1 then
  each('HDEL', KEYS[3], 13, device_end)  -- removed, or back on the device
end
each('SADD', KEYS[1], removed_end + 1, #ARGV)
each('HSET', KEYS[3], device_end + 1, host_end, ARGV[11])
each('HSET', KEYS[3], host_end + 1, #ARGV, ARGV[12])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
redis.call('PUBLISH', ARGV[7], ARGV[8])
return 1
"""


def blocks_key(node_id: str, epoch: str) -> str:
    return f"{SET_PREFIX}{node_id}:{epoch}"


def seq_key(node_id: str, epoch: str) -> str:
    return f"{SEQ_PREFIX}{node_id}:{epoch}"


def tiers_key(node_id: str, epoch: str) -> str:
    return f"{TIER_PREFIX}{node_id}:{epoch}"


NO_LOWER: Mapping[int, Tier] = MappingProxyType({})  # nothing held below the device


class NodeSnapshot(NamedTuple):
    seq: int | None  # the last batch applied; None: Redis holds nothing for the node
    hashes: set[int]  # every hash held, in any tier
    lower: Mapping[int, Tier] = NO_LOWER  # of those, the ones held only below the device, by tier


@dataclass(slots=True)
class IndexDelta:
    """A node's events since its last write, folded into one set change.

    Per hash the last event wins, and a clear drops everything before it, so applying
    ``clear`` (DEL) then ``removed`` (SREM) then ``stored`` (SADD) leaves the set as
    the events would, in any order within each step. ``stored`` and ``removed`` are
    disjoint. ``lower``: the stored hashes whose last store was below the device, with
    that tier (a move is a store with the new tier, so the last tier wins; a hash stored
    on the device again leaves it). A delta with ``clear`` is *full*: it alone
    determines the set.
    """

    clear: bool = False
    stored: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)
    lower: dict[int, Tier] = field(default_factory=dict)

    @classmethod
    def full(cls, held: Iterable[int] | Mapping[int, Tier]) -> IndexDelta:
        """The whole state of a node holding exactly ``held``: hashes (all on the
        device), or hash -> the fastest tier holding it."""
        if isinstance(held, Mapping):
            return cls(clear=True, stored=set(held),
                       lower={h: Tier(t) for h, t in held.items() if t != Tier.DEVICE})
        return cls(clear=True, stored=set(held))

    def fold(self, events: Iterable[KVEvent]) -> None:
        """Apply ``events`` (in stream order) on top of this delta."""
        lower = self.lower
        for ev in events:
            if isinstance(ev, BlockStored):
                self.stored.update(ev.block_hashes)
                self.removed.difference_update(ev.block_hashes)
                if ev.tier != Tier.DEVICE:
                    lower.update(dict.fromkeys(ev.block_hashes, Tier(ev.tier)))
                elif lower:
                    for h in ev.block_hashes:
                        lower.pop(h, None)
            elif isinstance(ev, BlockRemoved):
                self.removed.update(ev.block_hashes)
                self.stored.difference_update(ev.block_hashes)
                if lower:
                    for h in ev.block_hashes:
                        lower.pop(h, None)
            else:
                assert isinstance(ev, AllBlocksCleared), f"unknown KV event {ev!r}"
                self.clear = True
                self.stored.clear()
                self.removed.clear()
                lower.clear()

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
        lower = delta.lower
        device = [h for h in delta.stored if h not in lower] if lower else list(delta.stored)
        host = [h for h, t in lower.items() if t == Tier.HOST]
        disk = [h for h, t in lower.items() if t == Tier.DISK]
        update = msgspec.msgpack.encode(IndexUpdate(node_id, epoch, seq, delta.clear, device, removed,
                                                    host, disk))
        args = [prev, str(seq), self._ttl_ms, "1" if delta.clear else "0", len(removed),
                _ARGS_PER_CALL, EVENTS_CHANNEL, update, len(device), len(host), int(Tier.HOST),
                int(Tier.DISK), *map(str, removed), *map(str, device), *map(str, host), *map(str, disk)]
        keys = [blocks_key(node_id, epoch), seq_key(node_id, epoch), tiers_key(node_id, epoch)]
        return await self._apply(keys=keys, args=args) == 1

    async def refresh(self, node_id: str, epoch: str) -> bool:
        """Extend the TTL of the node's entries; False if its seq key is gone (Redis
        lost it: the caller must write its full state). One pipelined round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.pexpire(seq_key(node_id, epoch), self._ttl_ms)
            pipe.pexpire(blocks_key(node_id, epoch), self._ttl_ms)
            pipe.pexpire(tiers_key(node_id, epoch), self._ttl_ms)
            seq_alive, _, _ = await pipe.execute()
        return bool(seq_alive)

    async def drop(self, node_id: str, epoch: str) -> None:
        """Delete the node's entries now (a clean shutdown); idempotent."""
        await self._redis.delete(blocks_key(node_id, epoch), seq_key(node_id, epoch),
                                 tiers_key(node_id, epoch))

    # -- router side -----------------------------------------------------------------

    async def publish(self, channel: str, data: bytes) -> None:
        """One PUBLISH on this index's pool (router replicas share their recent work)."""
        await self._redis.publish(channel, data)

    def pubsub(self):
        """A pub/sub client on this index's connection pool (the caller subscribes to
        ``EVENTS_CHANNEL``, reads the confirmation, and closes it)."""
        return self._redis.pubsub()

    async def snapshot(self, node_id: str, epoch: str) -> NodeSnapshot:
        """Everything (node_id, epoch) holds, with the tier of what it holds below the
        device, and the seq of the batch it is as of, read atomically (one MULTI)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.get(seq_key(node_id, epoch))
            pipe.smembers(blocks_key(node_id, epoch))
            pipe.hgetall(tiers_key(node_id, epoch))
            raw_seq, members, tiers = await pipe.execute()
        return NodeSnapshot(None if raw_seq is None else int(raw_seq), {int(m) for m in members},
                            {int(h): Tier(int(t)) for h, t in tiers.items()} if tiers else NO_LOWER)

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
