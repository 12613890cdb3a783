"""The response store's budgets on a real redis-server (router/responses/store.py): sizes
in UTF-8 bytes, a quota per key (bytes and entries) that refuses the key over it and
never touches another key's entries, a global byte budget shared out fairly, and the
bytes of deleted and expired entries given back; Redis's own error text never reaches
a client."""

import asyncio
import logging

import pytest

from splitserve.common.outcomes import StoreResult
from splitserve.router.config import RouterConfig
from splitserve.router.errors import ApiError
from splitserve.router.responses.store import ENTRY_OVERHEAD_BYTES, MAX_ENTRY_BYTES, ResponseStore, refusal

pytestmark = pytest.mark.anyio
KiB = 1024


def response(i: int | str) -> dict:
    return {"id": f"resp_{i}", "object": "response", "output": []}


def history(nbytes: int, char: str = "x") -> list[dict]:
    """A conversation of about ``nbytes`` UTF-8 bytes."""
    return [{"type": "message", "role": "user", "content": char * (nbytes // len(char.encode()))}]


@pytest.fixture
async def store(redis_url):
    made: list[ResponseStore] = []

    def make(**budget) -> ResponseStore:
        d = RouterConfig()
        s = ResponseStore(redis_url, **{"max_bytes": d.responses_max_bytes, "key_max_bytes": d.responses_key_max_bytes,
                                        "key_max_entries": d.responses_key_max_entries,
                                        "thread_bytes": d.prepare_thread_bytes, **budget})
        made.append(s)
        return s
    yield make
    if made:
        await made[0]._redis.flushdb()
    for s in made:
        await s.close()


async def test_a_key_over_its_quota_is_refused_and_the_others_keep_theirs(store):
    s = store(max_bytes=1 << 20, key_max_bytes=64 * KiB, key_max_entries=100)
    for i in range(3):
        assert (await s.put(response(f"b{i}"), history(4 * KiB), "owner-b")).result is StoreResult.STORED
    results = [(await s.put(response(f"a{i}"), history(8 * KiB), "owner-a")) for i in range(20)]
    stored = [v for v in results if v.result is StoreResult.STORED]
    assert 5 <= len(stored) <= 7  # 64 KiB / (8 KiB + overhead)
    assert all(v.result is StoreResult.KEY_FULL for v in results[len(stored):])
    err = refusal(results[-1])
    assert err is not None and err.status == 429 and err.type == "rate_limit_error"
    assert 1 <= int(err.headers["Retry-After"]) <= s.ttl_s
    assert (await s.admit("owner-a", 8 * KiB)).result is StoreResult.KEY_FULL  # refused before generating
    for i in range(3):  # nothing of B's was evicted, and B still stores
        got = await s.get(f"resp_b{i}", "owner-b")
        assert got is not None and got.response["id"] == f"resp_b{i}"
    assert (await s.put(response("b3"), history(4 * KiB), "owner-b")).result is StoreResult.STORED
    assert (await s.admit("owner-b", 8 * KiB)).result is StoreResult.STORED


async def test_entries_are_counted_per_key(store):
    s = store(max_bytes=1 << 20, key_max_bytes=1 << 20, key_max_entries=3)
    got = [(await s.put(response(i), history(100), "owner-a")).result for i in range(5)]
    assert got == [StoreResult.STORED] * 3 + [StoreResult.KEY_FULL] * 2
    assert (await s.put(response("other"), history(100), "owner-b")).result is StoreResult.STORED


async def test_sizes_are_utf8_bytes_not_characters(store):
    s = store()
    # 1.5 Mi characters of three bytes each: 4.5 MiB, over the entry limit of 4 MiB
    wide = history(3 * (1536 * KiB), "\u4e2d")
    assert len(wide[0]["content"]) < MAX_ENTRY_BYTES < len(wide[0]["content"].encode())
    assert (await s.put(response("wide"), wide, "owner-a")).result is StoreResult.TOO_LARGE
    assert await s.get("resp_wide", "owner-a") is None
    s2 = store(max_bytes=1 << 20, key_max_bytes=64 * KiB, key_max_entries=100)
    # 16 Ki three-byte characters: 48 KiB + the overhead fit a 64 KiB quota once, not twice
    assert (await s2.put(response("w1"), history(48 * KiB, "\u4e2d"), "owner-b")).result is StoreResult.STORED
    assert (await s2.put(response("w2"), history(48 * KiB, "\u4e2d"), "owner-b")).result is StoreResult.KEY_FULL
    usage = await s2.usage()
    assert usage.by_owner["owner-b"] == usage.total > 48 * KiB + ENTRY_OVERHEAD_BYTES


async def test_a_full_store_refuses_the_key_over_its_fair_share_and_evicts_nobody(store):
    s = store(max_bytes=64 * KiB, key_max_bytes=56 * KiB, key_max_entries=100)
    a = [(await s.put(response(f"a{i}"), history(4 * KiB), "owner-a")).result for i in range(8)]
    assert a == [StoreResult.STORED] * 8  # 5.5 KiB each (5 KiB allocated): A holds 44 of the 64, within its 56
    b = [(await s.put(response(f"b{i}"), history(4 * KiB), "owner-b")).result for i in range(12)]
    assert b.count(StoreResult.STORED) == 3  # then the budget is full
    # B holds less than its fair share (64 KiB / 2 owners): the store is full, a 503
    assert b[3:] == [StoreResult.STORE_FULL] * 9
    over = await s.put(response("a8"), history(4 * KiB), "owner-a")  # A holds more than its share
    assert over.result is StoreResult.OVER_SHARE and refusal(over).status == 429
    c = await s.put(response("c0"), history(4 * KiB), "owner-c")  # a newcomer, under its share
    assert c.result is StoreResult.STORE_FULL
    err = refusal(c)
    assert err.status == 503 and err.type == "service_unavailable" and int(err.headers["Retry-After"]) >= 1
    for i, r in enumerate(a):  # nothing of A's was evicted
        if r is StoreResult.STORED:
            assert await s.get(f"resp_a{i}", "owner-a") is not None
    usage = await s.usage()
    assert usage.total <= 64 * KiB and usage.total == sum(usage.by_owner.values())


async def test_deleting_and_expiry_give_the_bytes_back(store):
    s = store(max_bytes=1 << 20, key_max_bytes=16 * KiB, key_max_entries=100, ttl_s=1)
    assert (await s.put(response("a0"), history(6 * KiB), "owner-a")).result is StoreResult.STORED
    assert (await s.put(response("a1"), history(6 * KiB), "owner-a")).result is StoreResult.STORED
    assert (await s.put(response("a2"), history(6 * KiB), "owner-a")).result is StoreResult.KEY_FULL
    assert not await s.delete("resp_a1", "owner-b")  # not B's: nothing happens
    assert await s.get("resp_a1", "owner-a") is not None
    assert await s.delete("resp_a1", "owner-a")
    assert (await s.put(response("a2"), history(6 * KiB), "owner-a")).result is StoreResult.STORED
    assert (await s.put(response("b0"), history(1 * KiB), "owner-b")).result is StoreResult.STORED
    await asyncio.sleep(1.2)  # every entry expires
    # a put of another key gives back every expired entry's bytes, A's included
    assert (await s.put(response("c0"), history(1 * KiB), "owner-c")).result is StoreResult.STORED
    usage = await s.usage()
    assert set(usage.by_owner) == {"owner-c"} and usage.total == usage.by_owner["owner-c"]
    assert (await s.put(response("a3"), history(6 * KiB), "owner-a")).result is StoreResult.STORED


async def test_an_unreachable_store_answers_a_generic_503_and_logs_the_cause(caplog):
    from splitserve.deploy.launcher import free_port
    port = free_port()
    s = ResponseStore(f"redis://127.0.0.1:{port}/0", 1 << 20, 1 << 16, 10, 1 << 13)
    try:
        with caplog.at_level(logging.WARNING, logger="splitserve.router"):
            with pytest.raises(ApiError) as raised:
                await s.get("resp_x", "owner-a")
        err = raised.value
        assert err.status == 503 and err.headers["Retry-After"]
        assert str(port) not in err.message and "refused" not in err.message.lower()
        assert "Redis" not in err.message and "Error" not in err.message
        assert any(str(port) in r.getMessage() for r in caplog.records)  # the cause, in the log
        assert (await s.put(response("x"), history(10), "owner-a")).result is StoreResult.UNAVAILABLE
        assert refusal(await s.admit("owner-a", 100)) is None  # storing is skipped, the request goes on
    finally:
        await s.close()


def test_the_router_flags_set_the_store(monkeypatch):
    import argparse

    from splitserve.common.auth import RESPONSES_REDIS_URL_ENV
    from splitserve.router.config import add_router_args, router_config

    def config(*argv: str) -> RouterConfig:
        p = argparse.ArgumentParser()
        add_router_args(p)
        return router_config(p.parse_args(list(argv)))
    monkeypatch.delenv(RESPONSES_REDIS_URL_ENV, raising=False)
    plain = config("--redis-url", "redis://registry:6379/0")
    assert plain.responses_store_url == "redis://registry:6379/0"  # no Redis of their own: the node registry's
    assert (plain.responses_max_bytes, plain.responses_key_max_bytes) == (1 << 30, 64 << 20)
    monkeypatch.setenv(RESPONSES_REDIS_URL_ENV, "redis://:pw@responses:6379/0")
    own = config("--responses-max-bytes", "2GiB", "--responses-key-max-bytes", "8MiB",
                 "--responses-key-max-entries", "50")
    assert own.responses_store_url == "redis://:pw@responses:6379/0" and "pw" not in repr(own)
    assert (own.responses_max_bytes, own.responses_key_max_bytes, own.responses_key_max_entries) == (
        2 << 30, 8 << 20, 50)
    assert config("--responses-redis-url", "redis://flag:6379/1").responses_store_url == "redis://flag:6379/1"
    with pytest.raises(ValueError, match="--responses-key-max-bytes"):
        config("--responses-key-max-bytes", "lots")
    with pytest.raises(ValueError, match="responses_key_max_entries"):
        config("--responses-key-max-entries", "0")
