"""Stored responses, in Redis, so that ``previous_response_id`` works through any router
replica, and ``GET`` / ``DELETE /v1/responses/{id}`` do; and the budgets that keep one
API key from filling that Redis.

    string splitserve:response:<id>            {"owner", "response", "history": the
                                                conversation's items (input, then output)},
                                                expires after ttl_s (an hour)
    zset   splitserve:responses:expiry         "<owner> <id>" -> when it expires (every entry)
    zset   splitserve:responses:owner:<owner>  <id> -> when it expires (one owner's entries)
    hash   splitserve:responses:cost           "<owner> <id>" -> its cost in bytes
    hash   splitserve:responses:usage          <owner> -> the bytes its live entries cost
    string splitserve:responses:bytes          the bytes every live entry costs

An owner is a key's HMAC (router/http/auth.py), "-" on a router without API keys. An entry
costs what Redis allocates for its JSON's UTF-8 bytes (``allocated``: jemalloc's size
class, up to 25% more) plus ENTRY_OVERHEAD_BYTES (its key, TTL and index entries), so
the budgets bound Redis's memory, not a character count.
One Lua script per put (atomic, so every router replica shares the accounting) first
gives back the bytes of up to TRIM_BATCH expired entries of anyone (by their expiry
score; Redis's own TTL has dropped their text), then admits the entry or refuses it:

    entry over min(MAX_ENTRY_BYTES, key quota)   TOO_LARGE    not stored, the request succeeds
    the key's bytes or entries would pass        KEY_FULL     429, Retry-After: when its
      its quota                                               oldest entry expires
    the store's budget would pass, and the key   OVER_SHARE   429, the same Retry-After
      then holds over budget / owners
    the store's budget would pass, the key       STORE_FULL   503, Retry-After: when the
      within its share                                        store's oldest entry expires

Nothing is ever evicted to make room: a key pays for its own entries, and a full store
refuses the keys over their fair share (429) and the rest (503) until entries expire or
are deleted. Without API keys there is one owner, bounded by the store's budget only.
Redis down: storing is skipped with a log line (the request still succeeds); reading
raises a 503 with a generic message (the cause goes to the log, not to the client).
A stored entry belongs to its owner: another key's GET, DELETE or previous_response_id
finds nothing, as for an unknown id. The script touches keys it is not given (other
owners'), so the store needs one Redis, not a Redis Cluster.

Must not know the request's fields beyond these two objects.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, NamedTuple

from redis.exceptions import RedisError

from ...common.outcomes import StoreResult
from ...common.node_registry import make_redis
from ..errors import ApiError

log = logging.getLogger(__name__)

KEY_PREFIX = "splitserve:response:"
EXPIRY_KEY = "splitserve:responses:expiry"
OWNER_PREFIX = "splitserve:responses:owner:"
COST_KEY = "splitserve:responses:cost"
USAGE_KEY = "splitserve:responses:usage"
BYTES_KEY = "splitserve:responses:bytes"
ANONYMOUS = "-"  # the owner on a router without API keys
TTL_S = 3600  # a conversation's next turn comes within minutes; an agent's within seconds
MAX_ENTRY_BYTES = 4 << 20
# Redis's memory per entry beyond its text: the key and its TTL, two sorted-set members and
# a hash field (~350 bytes measured on Redis 7), rounded up.
ENTRY_OVERHEAD_BYTES = 512
TRIM_BATCH = 1000  # expired entries given back per put at most (the rest by the next puts)

_RELEASE = """
local function release(owner, id)
  local member = owner .. ' ' .. id
  local cost = tonumber(redis.call('HGET', KEYS[2], member))
  redis.call('ZREM', KEYS[1], member)
  if not cost then return 0 end
  redis.call('HDEL', KEYS[2], member)
  redis.call('ZREM', ARGV[10] .. owner, id)
  redis.call('DEL', ARGV[9] .. id)
  if redis.call('HINCRBY', KEYS[3], owner, -cost) <= 0 then redis.call('HDEL', KEYS[3], owner) end
  redis.call('DECRBY', KEYS[4], cost)
  return 1
end
"""
# KEYS: expiry zset, cost hash, usage hash, bytes, the owner's zset, the entry.
# ARGV: owner, id ("": only check that there is room for ``cost``), text, cost, ttl_s,
#       key max bytes, key max entries, max bytes, KEY_PREFIX, OWNER_PREFIX, TRIM_BATCH.
# Returns {result, retry after (s)}.
_PUT = _RELEASE + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[11]))) do
  local sep = string.find(member, ' ', 1, true)
  release(string.sub(member, 1, sep - 1), string.sub(member, sep + 1))
end
local function wait(zset)
  local first = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
  if first[2] then return math.max(1, math.ceil(tonumber(first[2]) - now)) end
  return 1
end
local owner, cost = ARGV[1], tonumber(ARGV[4])
local used = tonumber(redis.call('HGET', KEYS[3], owner) or '0')
if redis.call('ZCARD', KEYS[5]) + 1 > tonumber(ARGV[7]) or used + cost > tonumber(ARGV[6]) then
  return {'key_full', wait(KEYS[5])}
end
local budget = tonumber(ARGV[8])
if tonumber(redis.call('GET', KEYS[4]) or '0') + cost > budget then
  local owners = redis.call('HLEN', KEYS[3])
  if used == 0 then owners = owners + 1 end
  if used + cost > budget / owners then return {'over_share', wait(KEYS[5])} end
  return {'store_full', wait(KEYS[1])}
end
if ARGV[2] ~= '' then
  local expires = now + tonumber(ARGV[5])
  redis.call('SET', KEYS[6], ARGV[3], 'EX', ARGV[5])
  redis.call('ZADD', KEYS[1], expires, owner .. ' ' .. ARGV[2])
  redis.call('ZADD', KEYS[5], expires, ARGV[2])
  redis.call('HSET', KEYS[2], owner .. ' ' .. ARGV[2], cost)
  redis.call('HINCRBY', KEYS[3], owner, cost)
  redis.call('INCRBY', KEYS[4], cost)
end
return {'stored', 0}
"""
# KEYS: expiry zset, cost hash, usage hash, bytes. ARGV: owner, id, ..., KEY_PREFIX (9), OWNER_PREFIX (10).
_DELETE = _RELEASE + "return release(ARGV[1], ARGV[2])"


class Verdict(NamedTuple):
    result: StoreResult
    retry_after_s: int = 0  # refused: when the key may store again (an entry of its expires)


class Stored(NamedTuple):
    response: dict[str, Any]
    history: list[dict[str, Any]]
    nbytes: int  # the entry's size: how much work its conversation is to prepare


class Usage(NamedTuple):
    total: int  # bytes the live entries cost
    by_owner: dict[str, int]  # owner -> bytes


class ResponseStore:
    """The budgets (bytes in all, and per key bytes and entries) are RouterConfig's
    responses_* settings, with their defaults; ``thread_bytes`` its prepare_thread_bytes."""

    def __init__(self, redis_url: str, max_bytes: int, key_max_bytes: int, key_max_entries: int,
                 thread_bytes: int, ttl_s: int = TTL_S):
        self._redis = make_redis(redis_url)
        self._put = self._redis.register_script(_PUT)
        self._delete = self._redis.register_script(_DELETE)
        self.max_bytes, self.key_max_bytes, self.key_max_entries = max_bytes, key_max_bytes, key_max_entries
        self.ttl_s = ttl_s
        self.thread_bytes = thread_bytes  # larger entries are parsed on a worker thread

    async def admit(self, owner: str | None, nbytes: int) -> Verdict:
        """Whether ``owner`` has room for one more entry of about ``nbytes`` (a request's
        body and stored history: the entry holds both, and the output), checked before a
        generation that will be stored, so a key over its quota is refused before any work."""
        return await self._run(owner, "", b"", allocated(min(nbytes, MAX_ENTRY_BYTES)) + ENTRY_OVERHEAD_BYTES)

    async def put(self, response: dict[str, Any], history: list[dict[str, Any]], owner: str | None,
                  large: bool = False) -> Verdict:
        """Store ``response`` with its conversation for ``owner`` (``large``: serialize it on
        a worker thread), or say why not."""
        entry = {"owner": owner, "response": response, "history": history}
        dump = lambda: json.dumps(entry, ensure_ascii=False).encode()  # noqa: E731
        data = await asyncio.to_thread(dump) if large else dump()
        limit = min(MAX_ENTRY_BYTES, self._limits(owner)[0])
        if len(data) > limit:
            log.warning("router: response %s not stored: %d bytes, over %d", response["id"], len(data), limit)
            return Verdict(StoreResult.TOO_LARGE)
        verdict = await self._run(owner, response["id"], data, allocated(len(data)) + ENTRY_OVERHEAD_BYTES)
        if verdict.result is not StoreResult.STORED:
            log.info("router: response %s not stored: %s", response["id"], verdict.result)
        return verdict

    async def get(self, response_id: str, owner: str | None) -> Stored | None:
        """``owner``'s stored entry, or None (unknown, deleted, expired, or another owner's)."""
        try:
            raw = await self._redis.get(KEY_PREFIX + response_id)
        except RedisError as e:
            raise _unavailable(e) from None
        if raw is None:
            return None
        entry = await asyncio.to_thread(json.loads, raw) if len(raw) > self.thread_bytes else json.loads(raw)
        if entry.get("owner") != owner:
            return None
        return Stored(entry["response"], entry["history"], len(raw))

    async def delete(self, response_id: str, owner: str | None) -> bool:
        """Deletes ``owner``'s entry and gives its bytes back; False when there is none of theirs."""
        try:
            deleted = await self._delete(keys=[EXPIRY_KEY, COST_KEY, USAGE_KEY, BYTES_KEY],
                                         args=[_owner(owner), response_id, *[""] * 6, KEY_PREFIX, OWNER_PREFIX])
        except RedisError as e:
            raise _unavailable(e) from None
        return bool(deleted)

    async def usage(self) -> Usage:
        """The bytes the live entries cost, in all and per owner (expired ones until a put trims them)."""
        total, by_owner = await asyncio.gather(self._redis.get(BYTES_KEY), self._redis.hgetall(USAGE_KEY))
        return Usage(int(total or 0), {_text(k): int(v) for k, v in by_owner.items()})

    async def close(self) -> None:
        await self._redis.aclose()

    def _limits(self, owner: str | None) -> tuple[int, int]:
        """(bytes, entries) ``owner`` may hold: its key's quota; the whole budget without keys."""
        if owner is None:
            return self.max_bytes, self.max_bytes // ENTRY_OVERHEAD_BYTES
        return self.key_max_bytes, self.key_max_entries

    async def _run(self, owner: str | None, response_id: str, data: bytes, cost: int) -> Verdict:
        who = _owner(owner)
        key_bytes, key_entries = self._limits(owner)
        try:
            result, wait = await self._put(
                keys=[EXPIRY_KEY, COST_KEY, USAGE_KEY, BYTES_KEY, OWNER_PREFIX + who, KEY_PREFIX + response_id],
                args=[who, response_id, data, cost, self.ttl_s, key_bytes, key_entries, self.max_bytes,
                      KEY_PREFIX, OWNER_PREFIX, TRIM_BATCH])
        except RedisError as e:
            log.warning("router: the response store's Redis failed, %s not stored: %s: %s",
                        response_id or "an entry", type(e).__name__, e)
            return Verdict(StoreResult.UNAVAILABLE)
        return Verdict(StoreResult(_text(result)), int(wait))


def refusal(verdict: Verdict) -> ApiError | None:
    """The error answer of a refused store (429 / 503 with Retry-After); None when the
    request may go on (stored, too large, Redis down: those are logged, not refused)."""
    wait = {"Retry-After": str(max(1, verdict.retry_after_s))}
    if verdict.result in (StoreResult.KEY_FULL, StoreResult.OVER_SHARE):
        why = ("its quota of stored responses" if verdict.result is StoreResult.KEY_FULL
               else "its share of the full response store")
        return ApiError(429, f"this API key has used {why}: delete stored responses "
                        "(DELETE /v1/responses/{id}), wait for the oldest to expire, or send "
                        '"store": false', code="rate_limit_exceeded", headers=wait)
    if verdict.result is StoreResult.STORE_FULL:
        return ApiError(503, 'the response store is full; retry later, or send "store": false',
                        headers=wait)
    return None


def allocated(nbytes: int) -> int:
    """What jemalloc (Redis's allocator) takes for ``nbytes``: four size classes per
    doubling, e.g. 17,000 -> 20,480."""
    if nbytes <= 128:
        return max(16, -(-nbytes // 16) * 16)
    step = 1 << ((nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _owner(owner: str | None) -> str:
    return ANONYMOUS if owner is None else owner


def _unavailable(e: RedisError) -> ApiError:
    log.warning("router: the response store's Redis failed: %s: %s", type(e).__name__, e)
    return ApiError(503, "the response store is unavailable; retry shortly", headers={"Retry-After": "1"})
