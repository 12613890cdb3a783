"""Router replicas share cache_aware's recent work per node through Redis pub/sub
(router/routing/shared_work.py): each router's decisions reach the others' balance term, so
they weigh nodes alike; without Redis a router keeps counting its own. The app
builds its policy once and shares the recent work the policy declares (none for the
load-only policies)."""

import asyncio
import time

import pytest

from splitserve.common.kv_index import KVIndex
from splitserve.router import app as router_app
from splitserve.router.routing.cache_aware import CacheAware
from splitserve.router.config import RouterConfig
from splitserve.router.routing.shared_work import SharedWork
from splitserve.router.http.state import POLICY, SERVICES

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


@pytest.mark.parametrize("policy", ["cache_aware", "least_load"])
async def test_the_app_builds_its_policy_once_and_shares_its_recent_work(redis_url, monkeypatch, policy):
    built, real = [], router_app.make_policy

    def make_policy(*args):
        built.append(real(*args))
        return built[-1]

    monkeypatch.setattr(router_app, "make_policy", make_policy)
    running = await router_app.start_router(RouterConfig(port=0, redis_url=redis_url, policy=policy))
    app = running.runner.app
    try:
        assert len(built) == 1 and built[0].name == policy
        assert app[POLICY] is built[0] and app[SERVICES].dispatcher.policy is built[0]
        recent = built[0].recent
        if policy == "cache_aware":  # its recent work goes out to the other replicas
            assert recent is not None and recent.listener is not None
        else:
            assert recent is None
    finally:
        await running.stop()
    assert len(built) == 1
    if recent is not None:
        assert recent.listener is None  # the sharing stopped with the app
