"""The global prefix-cache index in Redis: which node (at which epoch) holds which
block hashes, written by the nodes, read by the router.

Owns the Redis layout, the folding of a node's event stream into one write, and
the two Lua scripts (an atomic, sequence-checked write and the longest-run lookup).
Must not: import torch or node code, decide when to write or what to do when Redis
is down (callers do: the node's publisher resyncs, the router degrades to load-only;
every method here raises one of ``REDIS_ERRORS`` when Redis is unreachable).

Data model: one Redis SET per (node, epoch) of the block hashes that node holds,
plus the sequence number of the last batch written into it::

    splitserve:kv:{node_id}:{epoch}     SET  {block hash as unsigned decimal, ...}   PX ttl
    splitserve:kvseq:{node_id}:{epoch}  STR  last applied batch seq                  PX ttl

- Write (one batch per node per flush interval): ``EVALSHA apply`` = the delta folded
  from the batch's events (clear?, SREM removed, SADD stored), SET seq, PEXPIRE both,
  atomically; only if the stored seq is the batch's predecessor. A missing or other seq
  (Redis restarted, the keys expired, a write was lost) refuses the batch: the node then
  rewrites its whole state (a *full* write: DEL + SADD of every held hash, which needs
  no predecessor). One round trip per batch.
- Refresh (every heartbeat-ish interval): PEXPIRE both keys, pipelined; a node that
  stops refreshing (crash, partition) loses its entries after ``ttl_s``.
- ``AllBlocksCleared`` makes the batch full: the set is deleted first.
- Epochs: readers build keys from the (node_id, epoch) of the registry's live record,
  so a restarted node's old set (old epoch) is never read; it just expires.
- Lookup: ``EVALSHA longest_runs`` with one key per candidate node and the request's
  chained hashes; per node, a binary search for the last held hash. One round trip;
  cost 1 + log2(blocks) SISMEMBER per node, each O(1) (a linear scan from the root
  cost nodes x shared blocks: 80 nodes all holding a 2k-token system prompt meant
  ~10,000 calls, ~10 ms). The search relies on each set being prefix-closed (a held
  block's ancestors are held), which engines keep by evicting a sequence's tail
  first (KVCacheManager.free); a set with a hole may be read long, and the router
  counts that as a misprediction. Memory: about 60-80 bytes per (block, node) entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from splitserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from splitserve.common.registry import REDIS_ERRORS, NodeInfo, make_redis

__all__ = ["KVIndex", "IndexDelta", "REDIS_ERRORS", "blocks_key", "seq_key"]

SET_PREFIX = "splitserve:kv:"
SEQ_PREFIX = "splitserve:kvseq:"
_ARGS_PER_CALL = 1000  # members per SADD / SREM inside the script (Lua's unpack limit is ~8000)

# KEYS[1] set, KEYS[2] seq. ARGV: prev seq ("" = full write, no check), new seq, ttl ms,
# clear "1"|"0", number of removed hashes, members per SADD/SREM, removed..., stored...
# Returns 1 when applied, 0 when the stored seq is not ``prev`` (nothing changed).
_APPLY_LUA = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
if ARGV[4] == '1' then redis.call('DEL', KEYS[1]) end
local chunk = tonumber(ARGV[6])
local first_add = 7 + tonumber(ARGV[5])
local i = 7
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
return 1
"""

# KEYS: one set per node. ARGV: the request's chained hashes, root first.
# Returns, per key, how many leading hashes the set holds.
# Per key, binary search for the last held hash: lo blocks are known held, blocks past hi
# are known missing.
_LONGEST_RUNS_LUA = """
local out = {}
for k = 1, #KEYS do
  local lo, hi = 0, #ARGV
  if redis.call('SISMEMBER', KEYS[k], ARGV[1]) == 0 then hi = 0 else lo = 1 end
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if redis.call('SISMEMBER', KEYS[k], ARGV[mid]) == 1 then lo = mid else hi = mid - 1 end
  end
  out[k] = lo
end
return out
"""


def blocks_key(node_id: str, epoch: str) -> str:
    return f"{SET_PREFIX}{node_id}:{epoch}"


def seq_key(node_id: str, epoch: str) -> str:
    return f"{SEQ_PREFIX}{node_id}:{epoch}"


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
        self._longest_runs = self._redis.register_script(_LONGEST_RUNS_LUA)

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
        removed = [] if delta.clear else [str(h) for h in delta.removed]
        args = [prev, str(seq), self._ttl_ms, "1" if delta.clear else "0", len(removed),
                _ARGS_PER_CALL, *removed, *(str(h) for h in delta.stored)]
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

    async def longest_runs(self, block_hashes: Sequence[int],
                           nodes: Sequence[NodeInfo]) -> dict[str, int]:
        """node_id -> how many leading ``block_hashes`` the node holds at the epoch of
        its record (entries of any other epoch are never read). One round trip; none
        when there is nothing to look up."""
        if not block_hashes or not nodes:
            return {}
        keys = [blocks_key(n.node_id, n.epoch) for n in nodes]
        runs = await self._longest_runs(keys=keys, args=[str(h) for h in block_hashes])
        return {n.node_id: int(r) for n, r in zip(nodes, runs)}

    # -- inspection (tests, debugging) ---------------------------------------------------

    async def members(self, node_id: str, epoch: str) -> set[int]:
        """Every hash held by (node_id, epoch)."""
        return {int(m) for m in await self._redis.smembers(blocks_key(node_id, epoch))}

    async def last_seq(self, node_id: str, epoch: str) -> int | None:
        raw = await self._redis.get(seq_key(node_id, epoch))
        return None if raw is None else int(raw)

    async def close(self) -> None:
        await self._redis.aclose()
