"""The Redis prefix index against a real redis-server: event folding, the updates
published with each applied write, snapshots and the seq listing routers resync
from, sequence-checked batches, full rewrites, TTL and refresh, large batches, and
fast errors when Redis is down."""

import asyncio

import msgspec
import pytest

from splitserve.common.hashing import hash_blocks
from splitserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, IndexUpdate
from splitserve.common.kv_index import (EVENTS_CHANNEL, REDIS_ERRORS, IndexDelta, KVIndex,
                                        NodeSnapshot, blocks_key)
from splitserve.common.node_registry import NodeInfo, new_epoch
from splitserve.deploy.launcher import free_port

pytestmark = pytest.mark.anyio

BS = 4
EXTRA = ("m",)


def chain(n_blocks: int, start: int = 0) -> list[int]:
    return hash_blocks(list(range(start, start + n_blocks * BS)), BS, EXTRA)


def stored(hashes: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes)


def node(node_id: str, epoch: str | None = None) -> NodeInfo:
    return NodeInfo(node_id=node_id, role="prefill", http_addr="http://127.0.0.1:1", model="m",
                    epoch=epoch or new_epoch())


@pytest.fixture
async def index(redis_url):
    idx = KVIndex(redis_url, ttl_s=30.0)
    await idx._redis.flushdb()
    yield idx
    await idx.close()


def test_fold_keeps_the_last_event_per_hash_and_a_clear_drops_the_past():
    a, b, c = chain(3)
    d = IndexDelta()
    d.fold([stored([a, b]), BlockRemoved(block_hashes=[b]), BlockRemoved(block_hashes=[c]),
            stored([c])])
    assert (d.clear, d.stored, d.removed) == (False, {a, c}, {b})
    d.fold([AllBlocksCleared(), stored([b])])
    assert (d.clear, d.stored, d.removed) == (True, {b}, set())
    assert not IndexDelta() and IndexDelta(clear=True)


async def test_applied_writes_are_published_and_snapshots_match(index):
    h = chain(6)
    a, b = node("a"), node("b")
    pubsub = index.pubsub()
    await pubsub.subscribe(EVENTS_CHANNEL)
    try:
        assert await index.apply("a", a.epoch, IndexDelta.full(h[:4]), seq=1)
        assert await index.apply("a", a.epoch, IndexDelta(stored={h[4]}, removed={h[0]}), seq=2)
        assert not await index.apply("a", a.epoch, IndexDelta(stored={h[5]}), seq=4)  # refused: not published
        assert await index.apply("b", b.epoch, IndexDelta.full(h[:2]), seq=1)
        got = []
        while len(got) < 3:
            msg = await pubsub.get_message(timeout=2.0)
            assert msg is not None, f"only {len(got)} updates published"
            if msg["type"] == "message":
                got.append(msgspec.msgpack.decode(msg["data"], type=IndexUpdate))
        assert await pubsub.get_message(timeout=0.2) is None
    finally:
        await pubsub.aclose()
    assert got[0] == IndexUpdate("a", a.epoch, 1, True, got[0].stored, [])
    assert set(got[0].stored) == set(h[:4])
    assert got[1] == IndexUpdate("a", a.epoch, 2, False, [h[4]], [h[0]])
    assert got[2].node_id == "b" and got[2].clear and set(got[2].stored) == set(h[:2])
    assert await index.snapshot("a", a.epoch) == NodeSnapshot(2, set(h[1:5]))
    assert await index.snapshot("a", new_epoch()) == NodeSnapshot(None, set())
    assert await index.published_seqs() == {("a", a.epoch): 2, ("b", b.epoch): 1}


async def test_batches_apply_in_sequence_and_a_gap_is_refused(index):
    e = new_epoch()
    h = chain(4)
    assert await index.apply("n", e, IndexDelta.full(h[:2]), seq=1)
    d2 = IndexDelta()
    d2.fold([stored([h[2]]), BlockRemoved(block_hashes=[h[0]])])
    assert await index.apply("n", e, d2, seq=2)
    assert await index.members("n", e) == {h[1], h[2]} and await index.last_seq("n", e) == 2
    d4 = IndexDelta()
    d4.fold([stored([h[3]])])
    assert not await index.apply("n", e, d4, seq=4)  # batch 3 never arrived
    assert await index.members("n", e) == {h[1], h[2]} and await index.last_seq("n", e) == 2
    # Redis loses everything (restart): deltas are refused until a full write
    await index._redis.flushdb()
    assert not await index.apply("n", e, d4, seq=5)
    assert await index.members("n", e) == set()
    assert await index.apply("n", e, IndexDelta.full(h), seq=6)
    assert await index.members("n", e) == set(h)


async def test_clear_wipes_the_node_and_only_that_node(index):
    e1, e2 = new_epoch(), new_epoch()
    h = chain(3)
    await index.apply("n1", e1, IndexDelta.full(h), seq=1)
    await index.apply("n2", e2, IndexDelta.full(h), seq=1)
    d = IndexDelta()
    d.fold([AllBlocksCleared()])
    assert await index.apply("n1", e1, d, seq=2)
    assert await index.members("n1", e1) == set() and await index.members("n2", e2) == set(h)
    await index.drop("n2", e2)
    assert await index.members("n2", e2) == set() and await index.last_seq("n2", e2) is None


async def test_entries_expire_unless_refreshed(redis_url):
    idx = KVIndex(redis_url, ttl_s=0.4)
    try:
        h = chain(2)
        live, dead = node("live"), node("dead")
        await idx.apply("live", live.epoch, IndexDelta.full(h), seq=1)
        await idx.apply("dead", dead.epoch, IndexDelta.full(h), seq=1)
        for _ in range(4):
            await asyncio.sleep(0.2)
            assert await idx.refresh("live", live.epoch)
        seqs = await idx.published_seqs()
        assert ("live", live.epoch) in seqs and ("dead", dead.epoch) not in seqs
        assert await idx.members("dead", dead.epoch) == set()
        assert not await idx.refresh("dead", dead.epoch)  # gone: the node must rewrite
    finally:
        await idx.close()


async def test_batches_larger_than_one_redis_call(index):
    e = new_epoch()
    h = chain(2600)
    assert await index.apply("big", e, IndexDelta.full(h), seq=1)
    d = IndexDelta()
    d.fold([BlockRemoved(block_hashes=h[100:2600])])
    assert await index.apply("big", e, d, seq=2)
    assert await index.members("big", e) == set(h[:100])
    assert await index.snapshot("big", e) == NodeSnapshot(2, set(h[:100]))


async def test_unreachable_redis_raises_fast():
    idx = KVIndex(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)  # nothing listens
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(REDIS_ERRORS):
            await idx.snapshot("a", "e")
        with pytest.raises(REDIS_ERRORS):
            await idx.apply("a", "e", IndexDelta.full([1]), seq=1)
        assert loop.time() - t0 < 2.0
    finally:
        await idx.close()


def test_key_names_carry_node_and_epoch():
    assert blocks_key("prefill-0", "abc") == "splitserve:kv:prefill-0:abc"
