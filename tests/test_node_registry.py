"""The node registry against a real redis-server: heartbeat, list, TTL expiry,
deregister, the Heartbeat task, and a Redis outage that must not raise."""

import asyncio
import logging
import time

import pytest

from splitserve.deploy.launcher import free_port

from splitserve.common.load import NodeLoad
from splitserve.common.node_registry import KEY_PREFIX, REDIS_ERRORS, Heartbeat, NodeInfo, NodeRegistry, new_epoch

pytestmark = pytest.mark.anyio


@pytest.fixture
async def registry(redis_url):
    reg = NodeRegistry(redis_url, ttl_s=5.0)
    await reg._redis.flushdb()
    yield reg
    await reg.close()


def make_node(node_id="d0", role="decode", **kw) -> NodeInfo:
    kw.setdefault("http_addr", "http://127.0.0.1:9000")
    return NodeInfo(node_id=node_id, role=role, model="m", epoch=new_epoch(), **kw)


async def test_heartbeat_then_list_round_trips(registry):
    a = make_node("d0", load=NodeLoad(running=3, waiting=1, kv_usage=0.25, kv_free_blocks=7),
                  kv_backend="tcp", kv_addr="127.0.0.1:7000", capacity_tokens=4096)
    b = make_node("p0", role="prefill", load=NodeLoad(queued_prefill_tokens=512))
    await registry.heartbeat(b)
    await registry.heartbeat(a)
    nodes = await registry.list_nodes()
    assert nodes == [a, b]  # sorted by node_id, every field kept
    assert nodes[0].decode_capable and not nodes[1].decode_capable
    assert await registry._redis.exists(KEY_PREFIX + "d0") == 1


async def test_heartbeat_overwrites_with_new_load(registry):
    node = make_node()
    await registry.heartbeat(node)
    node.load = NodeLoad(running=9)
    await registry.heartbeat(node)
    [got] = await registry.list_nodes()
    assert got.load.running == 9


async def test_record_expires_after_ttl(redis_url, registry):
    short = NodeRegistry(redis_url, ttl_s=0.3)
    try:
        await short.heartbeat(make_node("gone"))
        assert [n.node_id for n in await short.list_nodes()] == ["gone"]
        ttl_ms = await short._redis.pttl(KEY_PREFIX + "gone")
        assert 0 < ttl_ms <= 300
        await asyncio.sleep(0.45)
        assert await short.list_nodes() == []
    finally:
        await short.close()


async def test_deregister_removes_at_once_and_is_idempotent(registry):
    await registry.heartbeat(make_node("d0"))
    await registry.heartbeat(make_node("d1"))
    await registry.deregister("d0")
    await registry.deregister("d0")
    assert [n.node_id for n in await registry.list_nodes()] == ["d1"]


async def test_undecodable_record_is_skipped(registry):
    await registry._redis.set(KEY_PREFIX + "bad", b"\x01not msgpack of a NodeInfo")
    await registry.heartbeat(make_node("d0"))
    assert [n.node_id for n in await registry.list_nodes()] == ["d0"]


async def test_heartbeat_task_keeps_node_alive_with_current_load(redis_url, registry):
    reg = NodeRegistry(redis_url, ttl_s=0.3)  # beats every 0.1 s
    load = {"running": 0}  # what the engine would publish
    node = make_node("hb")

    def info() -> NodeInfo:
        node.load = NodeLoad(**load)
        return node

    hb = Heartbeat(reg, info)
    try:
        hb.start()
        await asyncio.sleep(0.05)
        load["running"] = 4
        await asyncio.sleep(0.6)  # two TTLs: alive only because it keeps beating
        [got] = await reg.list_nodes()
        assert got.load.running == 4
        assert time.time() - got.updated_at < 0.3
        assert hb.beats >= 4 and hb.failures == 0
        await hb.stop()  # deregisters
        assert await reg.list_nodes() == []
    finally:
        await hb.stop()
        await reg.close()


async def test_heartbeat_stop_without_deregister_expires(redis_url, registry):
    reg = NodeRegistry(redis_url, ttl_s=0.3)
    hb = Heartbeat(reg, lambda: make_node("left"))
    try:
        hb.start()
        await asyncio.sleep(0.05)
        await hb.stop(deregister=False)
        assert [n.node_id for n in await reg.list_nodes()] == ["left"]
        await asyncio.sleep(0.4)
        assert await reg.list_nodes() == []
    finally:
        await reg.close()


async def test_redis_down_heartbeat_logs_and_does_not_raise(caplog):
    reg = NodeRegistry(f"redis://127.0.0.1:{free_port()}/0", ttl_s=0.3)  # nothing listens
    hb = Heartbeat(reg, lambda: make_node("lonely"))
    try:
        with caplog.at_level(logging.WARNING, logger="splitserve.common.node_registry"):
            assert await hb.beat() is False
            hb.start()
            await asyncio.sleep(0.35)  # a few more failed beats in the task
            assert not hb._task.done()  # still beating, nothing raised
            await hb.stop()  # the deregister fails too: logged, not raised
        assert hb.failures >= 2 and hb.beats == 0
        warnings = [r.getMessage() for r in caplog.records]
        # one warning for the outage (not one per beat) and one for the failed deregister
        assert sum("heartbeat of node lonely failed" in m for m in warnings) == 1
        assert sum("deregister of node lonely failed" in m for m in warnings) == 1
        with pytest.raises(REDIS_ERRORS):
            await reg.list_nodes()  # the node registry itself raises: callers choose the policy
    finally:
        await reg.close()


def test_ttl_must_be_positive():
    with pytest.raises(ValueError, match="ttl_s"):
        NodeRegistry("redis://127.0.0.1:1/0", ttl_s=0)
