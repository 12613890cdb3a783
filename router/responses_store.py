"""Stored responses, in Redis, so that ``previous_response_id`` works through any router
replica, and ``GET`` / ``DELETE /v1/responses/{id}`` do.

    key  splitserve:response:<id>    {"owner": a digest of the API key that created it
                                               (None when the router takes no key),
                                      "response": the response object,
                                      "history": the conversation's normalized items
                                                 (its input, then its output)}
                                     expires after ttl_s (an hour)
    zset splitserve:responses        id -> time stored: beyond max_entries, the oldest
                                     are deleted; an entry over MAX_ENTRY_BYTES is not stored

A stored response belongs to its owner: another key's GET, DELETE or
previous_response_id finds nothing, as for an unknown id (the id's existence is not
revealed). Bounded three ways: a TTL, a count, a size per entry. Redis down: storing is skipped
with a log line (the request still succeeds); reading raises a 503 naming the cause.

Must not know the request's fields beyond these two objects.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from redis.exceptions import RedisError

from ..common.registry import make_redis
from .errors import ApiError

log = logging.getLogger(__name__)

KEY_PREFIX = "splitserve:response:"
INDEX_KEY = "splitserve:responses"
TTL_S = 3600  # a conversation's next turn comes within minutes; an agent's within seconds
MAX_ENTRIES = 10_000
MAX_ENTRY_BYTES = 4 << 20


class ResponseStore:
    def __init__(self, redis_url: str, ttl_s: int = TTL_S, max_entries: int = MAX_ENTRIES):
        self._redis = make_redis(redis_url)
        self.ttl_s = ttl_s
        self.max_entries = max_entries

    async def put(self, response: dict[str, Any], history: list[dict[str, Any]], owner: str | None) -> bool:
        """Store ``response`` with its conversation for ``owner``; False when it could not be."""
        data = json.dumps({"owner": owner, "response": response, "history": history}, ensure_ascii=False)
        if len(data) > MAX_ENTRY_BYTES:
            log.warning("router: response %s not stored: %d bytes, over %d", response["id"],
                        len(data), MAX_ENTRY_BYTES)
            return False
        now = time.time()
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(KEY_PREFIX + response["id"], data, ex=self.ttl_s)
                pipe.zadd(INDEX_KEY, {response["id"]: now})
                pipe.zremrangebyscore(INDEX_KEY, "-inf", now - self.ttl_s)  # expired already
                pipe.zcard(INDEX_KEY)
                count = (await pipe.execute())[-1]
            if count > self.max_entries:
                oldest: list[tuple[bytes, float]] = await self._redis.zpopmin(
                    INDEX_KEY, count - self.max_entries)  # type: ignore[assignment]
                await self._redis.delete(*(KEY_PREFIX + rid.decode() for rid, _ in oldest))
        except RedisError as e:
            log.warning("router: response %s not stored: Redis: %s", response["id"], e)
            return False
        return True

    async def get(self, response_id: str, owner: str | None) -> dict[str, Any] | None:
        """The stored entry ({"owner", "response", "history"}) of ``owner``, or None
        (unknown, deleted, expired, or another owner's)."""
        try:
            raw = await self._redis.get(KEY_PREFIX + response_id)
        except RedisError as e:
            raise _unavailable(e) from None
        entry = None if raw is None else json.loads(raw)
        return entry if entry is not None and entry.get("owner") == owner else None

    async def delete(self, response_id: str, owner: str | None) -> bool:
        """Deletes ``owner``'s entry; False when there is none of theirs."""
        if await self.get(response_id, owner) is None:
            return False
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.delete(KEY_PREFIX + response_id)
                pipe.zrem(INDEX_KEY, response_id)
                deleted, _ = await pipe.execute()
        except RedisError as e:
            raise _unavailable(e) from None
        return bool(deleted)

    async def close(self) -> None:
        await self._redis.aclose()


def _unavailable(e: RedisError) -> ApiError:
    return ApiError(503, f"the response store (Redis) is unavailable: {e}",
                    headers={"Retry-After": "1"})
