"""Router replicas share cache_aware's recent work per node through Redis pub/sub
(router/shared_work.py): each router's decisions reach the others' balance term, so
they weigh nodes alike; without Redis a router keeps counting its own."""

import asyncio
import time

import pytest

from splitserve.common.kv_index import KVIndex
from splitserve.router.cache_aware import CacheAware
from splitserve.router.shared_work import SharedWork

pytestmark = pytest.mark.anyio


async def until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_replicas_see_each_others_recent_work(redis_url):
    a, b = CacheAware(), CacheAware()
    sa, sb = SharedWork(KVIndex(redis_url), a.recent), SharedWork(KVIndex(redis_url), b.recent)
    sa.start()
    sb.start()
    try:
        await asyncio.sleep(0.3)  # both subscribed
        now = time.monotonic()
        a.recent.add("p0", 1000.0, now)
        a.recent.add("p1", 250.0, now)
        b.recent.add("p1", 500.0, now)
        await until(lambda: sb.received == 2 and sa.received == 1)
        assert a.recent.replicas and b.recent.replicas  # each heard the other: work settles
        now = time.monotonic() + a.recent.settle_s  # work counts once every replica has heard it
        for node, want in (("p0", 1000.0), ("p1", 750.0)):
            assert a.recent.get(node, now) == pytest.approx(want, rel=1e-3)
            assert b.recent.get(node, now) == pytest.approx(want, rel=1e-3)
    finally:
        for s in (sa, sb):
            await s.stop()
            await s.index.close()
    assert a.recent.listener is None


async def test_without_redis_a_router_counts_its_own_work():
    c = CacheAware()
    s = SharedWork(KVIndex("redis://127.0.0.1:1/0", timeout_s=0.2), c.recent, retry_s=0.1)
    s.start()
    try:
        c.recent.add("p0", 100.0, time.monotonic())
        await asyncio.sleep(0.3)  # a flush that fails and a listener that retries
        assert c.recent.get("p0", time.monotonic()) == pytest.approx(100.0, rel=1e-3)
        assert not c.recent.replicas  # alone: its work counts at once
        c.recent.add("p1", 50.0, time.monotonic())
        assert c.recent.get("p1", time.monotonic()) == pytest.approx(50.0, rel=1e-3)
    finally:
        await s.stop()
        await s.index.close()
