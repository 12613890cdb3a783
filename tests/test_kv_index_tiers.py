"""The prefix index keeps each held hash's tier (device, host memory, disk), against a
real redis-server: the fold keeps the last tier of a hash within a batch (a move is a
store with the new tier), a remove after a move and a clear forget it; writes, full
rewrites, snapshots and the published IndexUpdate carry the tiers; a record or an
update from before tiers reads as all on the device; TTL refresh and drop cover the
tier keys; the index follows a real KVCacheManager with a host and a disk tier (its
events folded batch by batch, or its held blocks written whole, equal what it holds);
the router's mirror follows moves, resyncs with tiers and splits a hit by tier."""

import asyncio
import time

import msgspec
import pytest
import torch

from splitserve.common.hashing import hash_blocks, salt_id
from splitserve.common.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, IndexUpdate,
                                         Tier)
from splitserve.common.kv_index import (EVENTS_CHANNEL, IndexDelta, KVIndex, NodeSnapshot, blocks_key,
                                        seq_key, tiers_key)
from splitserve.common.node_registry import NodeInfo, new_epoch
from splitserve.engine.kv.cache_manager import KVCacheManager
from splitserve.engine.kv.disk_tier import DiskLayout, DiskTier
from splitserve.engine.kv.tier_store import TierSpec
from splitserve.router.metrics import RouterMetrics
from splitserve.router.routing.mirror_follower import MirrorFollower
from splitserve.router.routing.prefix_mirror import PrefixMirror
from splitserve.router.routing.tier_cost import TierBlocks

pytestmark = pytest.mark.anyio

BS = 16
MODEL = "m"
SALT = salt_id((MODEL,))
KEY = bytes(range(32))  # the disk tier's MAC key
HOST, DISK = Tier.HOST, Tier.DISK


def chain(n_blocks: int, start: int = 0) -> list[int]:
    return hash_blocks(list(range(start, start + n_blocks * BS)), BS, (MODEL,))


def node(node_id: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, role="prefill", http_addr="http://127.0.0.1:1", model=MODEL,
                    epoch=new_epoch(), block_size=BS)


@pytest.fixture
async def index(redis_url):
    idx = KVIndex(redis_url, ttl_s=30.0)
    await idx._redis.flushdb()
    yield idx
    await idx.close()


# -- the fold ----------------------------------------------------------------------------


def test_a_move_is_a_store_with_the_new_tier_and_the_last_tier_wins():
    a, b, c = chain(3)
    d = IndexDelta()
    d.fold([BlockStored([a, b, c]), BlockStored([b, c], tier=HOST), BlockStored([c], tier=DISK)])
    assert (d.stored, d.removed, d.lower) == ({a, b, c}, set(), {b: HOST, c: DISK})
    d.fold([BlockStored([b])])  # loaded back onto the device
    assert (d.stored, d.lower) == ({a, b, c}, {c: DISK})
    d.fold([BlockStored([c], tier=HOST)])  # from disk into host memory
    assert d.lower == {c: HOST}


def test_a_remove_after_a_move_and_a_clear_forget_the_tier():
    a, b, c = chain(3)
    d = IndexDelta()
    d.fold([BlockStored([a, b], tier=HOST), BlockRemoved([b])])
    assert (d.stored, d.removed, d.lower) == ({a}, {b}, {a: HOST})
    d.fold([BlockStored([b], tier=DISK)])  # stored again after its removal
    assert (d.stored, d.removed, d.lower) == ({a, b}, set(), {a: HOST, b: DISK})
    d.fold([AllBlocksCleared(), BlockStored([c], tier=DISK)])
    assert (d.clear, d.stored, d.removed, d.lower) == (True, {c}, set(), {c: DISK})
    # a move of a hash stored in an earlier batch: stored again, with its tier
    later = IndexDelta()
    later.fold([BlockStored([a], tier=DISK)])
    assert (later.stored, later.lower) == ({a}, {a: DISK}) and later


def test_a_full_state_from_hashes_or_from_hash_to_tier():
    a, b, c = chain(3)
    assert IndexDelta.full([a, b]) == IndexDelta(clear=True, stored={a, b})
    full = IndexDelta.full({a: Tier.DEVICE, b: HOST, c: DISK})
    assert (full.clear, full.stored, full.lower) == (True, {a, b, c}, {b: HOST, c: DISK})


# -- Redis -------------------------------------------------------------------------------


async def published(pubsub, n: int) -> list[IndexUpdate]:
    got = []
    while len(got) < n:
        msg = await pubsub.get_message(timeout=2.0)
        assert msg is not None, f"only {len(got)} updates published"
        if msg["type"] == "message":
            got.append(msgspec.msgpack.decode(msg["data"], type=IndexUpdate))
    return got


async def test_writes_snapshots_and_updates_carry_tiers(index):
    h = chain(6)
    e = new_epoch()
    pubsub = index.pubsub()
    await pubsub.subscribe(EVENTS_CHANNEL)
    try:
        assert await index.apply("n", e, IndexDelta.full({h[0]: Tier.DEVICE, h[1]: Tier.DEVICE,
                                                          h[2]: HOST, h[3]: DISK}), seq=1)
        assert await index.snapshot("n", e) == NodeSnapshot(1, set(h[:4]), {h[2]: HOST, h[3]: DISK})
        # h1 evicted into host memory, h2 loaded back, h3 moved up to host, h4 stored on disk
        moves = IndexDelta()
        moves.fold([BlockStored([h[1]], tier=HOST), BlockStored([h[2]]), BlockStored([h[3]], tier=HOST),
                    BlockStored([h[4]], tier=DISK)])
        assert await index.apply("n", e, moves, seq=2)
        assert await index.snapshot("n", e) == NodeSnapshot(2, set(h[:5]), {h[1]: HOST, h[3]: HOST,
                                                                             h[4]: DISK})
        # a remove after a move, and a device store: neither is below the device any more
        gone = IndexDelta()
        gone.fold([BlockStored([h[5]], tier=HOST), BlockRemoved([h[5], h[4]]), BlockStored([h[1]])])
        assert await index.apply("n", e, gone, seq=3)
        assert await index.snapshot("n", e) == NodeSnapshot(3, set(h[:4]), {h[3]: HOST})
        got = await published(pubsub, 3)
    finally:
        await pubsub.aclose()
    assert got[0].clear and sorted(got[0].stored) == sorted(h[:2])
    assert (got[0].stored_host, got[0].stored_disk) == ([h[2]], [h[3]])
    assert (sorted(got[1].stored), sorted(got[1].stored_host), got[1].stored_disk) == (
        [h[2]], sorted([h[1], h[3]]), [h[4]])
    assert (got[2].stored, sorted(got[2].removed), got[2].stored_host) == ([h[1]], sorted(h[4:6]), [])
    # a clear drops the tiers with the set; the full rewrite after it keeps only its own
    cleared = IndexDelta()
    cleared.fold([AllBlocksCleared(), BlockStored([h[0]], tier=DISK)])
    assert await index.apply("n", e, cleared, seq=4)
    assert await index.snapshot("n", e) == NodeSnapshot(4, {h[0]}, {h[0]: DISK})
    await index.apply("n", e, IndexDelta.full([h[0]]), seq=5)
    assert await index.snapshot("n", e) == NodeSnapshot(5, {h[0]})
    assert not await index._redis.exists(tiers_key("n", e))


async def test_a_device_only_node_writes_no_tier_key_and_old_records_read_as_device(index):
    h = chain(3)
    e = new_epoch()
    assert await index.apply("n", e, IndexDelta.full(h), seq=1)
    assert not await index._redis.exists(tiers_key("n", e))
    # a record written by a node from before tiers: a SET and a seq, no tier HASH
    old = new_epoch()
    await index._redis.sadd(blocks_key("old", old), *map(str, h))
    await index._redis.set(seq_key("old", old), "3")
    assert await index.snapshot("old", old) == NodeSnapshot(3, set(h))
    # and its update, published without the tier lists, decodes with them empty
    raw = msgspec.msgpack.encode({"type": "IndexUpdate", "node_id": "old", "epoch": old, "seq": 4,
                                  "stored": [h[0]]})
    u = msgspec.msgpack.decode(raw, type=IndexUpdate)
    assert (u.stored, u.stored_host, u.stored_disk) == ([h[0]], [], [])


async def test_refresh_and_drop_cover_the_tier_key(redis_url):
    idx = KVIndex(redis_url, ttl_s=0.4)
    try:
        h = chain(2)
        e = new_epoch()
        await idx.apply("n", e, IndexDelta.full({h[0]: HOST, h[1]: DISK}), seq=1)
        for _ in range(4):
            await asyncio.sleep(0.2)
            assert await idx.refresh("n", e)
        assert await idx.snapshot("n", e) == NodeSnapshot(1, set(h), {h[0]: HOST, h[1]: DISK})
        await idx.drop("n", e)
        assert not await idx._redis.exists(tiers_key("n", e), blocks_key("n", e), seq_key("n", e))
        await idx.apply("n", e, IndexDelta.full({h[0]: HOST}), seq=2)
        await asyncio.sleep(0.6)  # not refreshed: every key expires
        assert not await idx._redis.exists(tiers_key("n", e), blocks_key("n", e), seq_key("n", e))
    finally:
        await idx.close()


async def test_batches_of_tiers_larger_than_one_redis_call(index):
    e = new_epoch()
    h = chain(2600)
    held = {x: (Tier.DEVICE, HOST, DISK)[i % 3] for i, x in enumerate(h)}
    assert await index.apply("big", e, IndexDelta.full(held), seq=1)
    back = IndexDelta()
    back.fold([BlockStored(h[:2400]), BlockRemoved(h[2500:])])  # 1600 of them loaded back
    assert await index.apply("big", e, back, seq=2)
    snap = await index.snapshot("big", e)
    assert snap.hashes == set(h[:2500])
    assert snap.lower == {x: t for x, t in held.items() if x in set(h[2400:2500]) and t != Tier.DEVICE}


async def test_the_index_follows_a_cache_with_host_and_disk_tiers(index, tmp_path):
    """Blocks pushed from the device (3 blocks) into host memory (1 block) and on to disk,
    loaded back, then a reset: after every batch of the manager's own events Redis holds
    what ``held_blocks`` says, tiers included."""
    bs, shape = 4, (2, 2, 4, 1, 2)  # layers, K/V, block size, KV heads, head dim
    kv = torch.zeros((2, 2, 3, bs, 1, 2))
    disk = DiskTier(tmp_path, DiskLayout(MODEL, "float32", shape), kv[:, :, 0].numel() * 4, 64 << 10, KEY)
    mgr = KVCacheManager(3, bs, True, TierSpec(kv, 1, disk))
    e, seq = new_epoch(), 0
    seen: set[Tier] = set()  # the lower tiers the index held at some point

    async def publish(delta: IndexDelta) -> None:
        nonlocal seq
        seq += 1
        assert await index.apply("n", e, delta, seq)
        held = mgr.held_blocks()
        snap = await index.snapshot("n", e)
        assert (snap.hashes, dict(snap.lower)) == (set(held), {h: t for h, t in held.items() if t != Tier.DEVICE})
        seen.update(snap.lower.values())

    def serve(rid: str, tokens: list[int]) -> list[int]:
        hashes = hash_blocks(tokens, bs, (MODEL,))
        hit = mgr.get_computed_blocks(hashes, tokens, SALT)
        assert mgr.allocate_slots(rid, len(tokens), hit.blocks, hit.lower) is not None
        mgr.cache_blocks(rid, hashes, tokens, len(tokens), SALT)
        mgr.free(rid)
        return hashes

    try:
        await publish(IndexDelta.full(mgr.held_blocks()))
        first = serve("a", list(range(8)) + [1])  # 2 blocks (the last token is never a hit)
        for i, start in enumerate((20, 40, 60)):  # each evicts the one before: host, then disk
            d = IndexDelta()
            d.fold(mgr.take_events())
            await publish(d)
            serve(f"b{i}", list(range(start, start + 8)) + [1])
        disk.close()  # the writer finished its queue: every spilled block is on disk
        d = IndexDelta()
        d.fold(mgr.take_events())
        await publish(d)
        assert {mgr.held_blocks()[h] for h in first} == {Tier.DISK} and seen == {HOST, DISK}
        serve("a2", list(range(8)) + [1])  # loaded back from disk onto the device
        d = IndexDelta()
        d.fold(mgr.take_events())
        assert d.stored >= set(first)
        await publish(d)
        assert {h: mgr.held_blocks()[h] for h in first} == dict.fromkeys(first, Tier.DEVICE)
        await publish(IndexDelta.full(mgr.held_blocks()))  # a resync writes the same state whole
        assert mgr.reset_prefix_cache()
        d = IndexDelta()
        d.fold(mgr.take_events())
        assert d.clear
        await publish(d)
        assert await index.snapshot("n", e) == NodeSnapshot(seq, set())
    finally:
        disk.close()


# -- the router's mirror -----------------------------------------------------------------


async def until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def mirror(url: str) -> MirrorFollower:
    px = MirrorFollower(PrefixMirror(RouterMetrics.create(MODEL), MODEL, BS), KVIndex(url, timeout_s=0.5),
                        check_interval_s=0.2, retry_s=0.2)
    px.start()
    return px


async def test_the_mirror_splits_each_hit_by_tier_and_follows_moves(redis_url):
    prompt = list(range(100, 100 + 8 * BS + 5))  # 8 full blocks
    h = hash_blocks(prompt, BS, (MODEL,))
    writer = KVIndex(redis_url)
    await writer._redis.flushdb()  # no node of the tests before
    px = mirror(redis_url)
    a, b, c = node("a"), node("b"), node("c")
    try:
        await until(lambda: px.mirror.connected)
        await writer.apply("a", a.epoch, IndexDelta.full({**dict.fromkeys(h[:3], Tier.DEVICE),
                                                          **dict.fromkeys(h[3:6], HOST),
                                                          **dict.fromkeys(h[6:], DISK)}), seq=1)
        await writer.apply("b", b.epoch, IndexDelta.full(h[:4]), seq=1)
        await writer.apply("c", c.epoch, IndexDelta.full({h[0]: HOST, h[2]: DISK}), seq=1)  # a hole at h1
        await until(lambda: px.mirror.nodes_mirrored().keys() == {(n.node_id, n.epoch) for n in (a, b, c)})
        hits = px.mirror.lookup(prompt, [a, b, c])
        # a lower-tier block still counts as held: a holds all 8
        assert hits.cached == {"a": 8 * BS, "b": 4 * BS, "c": BS}
        assert hits.tiers == {"a": TierBlocks(3, 3, 2), "b": TierBlocks(4), "c": TierBlocks(0, 1, 0)}
        # moves: a's h3 loads back, h0 goes to host, h7 is dropped from disk
        d = IndexDelta()
        d.fold([BlockStored([h[3]]), BlockStored([h[0]], tier=HOST), BlockRemoved([h[7]])])
        await writer.apply("a", a.epoch, d, seq=2)
        await until(lambda: px.mirror.lookup(prompt, [a]).tiers == {"a": TierBlocks(3, 3, 1)})
        assert px.mirror.lookup(prompt, [a]).cached == {"a": 7 * BS}
        # a resync (a new router starting late) reads the same tiers from the snapshot
        late = mirror(redis_url)
        try:
            await until(lambda: late.mirror.lookup(prompt, [a, b, c]) == px.mirror.lookup(prompt, [a, b, c]))
            assert late.resyncs >= 3
        finally:
            await late.stop()
            await late.index.close()
        # a clear on a: everything it held in every tier is gone
        cleared = IndexDelta()
        cleared.fold([AllBlocksCleared()])
        await writer.apply("a", a.epoch, cleared, seq=3)
        await until(lambda: "a" not in px.mirror.lookup(prompt, [a]).cached)
        assert not px.mirror._nodes[("a", a.epoch)].lower
    finally:
        await px.stop()
        await px.index.close()
        await writer.close()
