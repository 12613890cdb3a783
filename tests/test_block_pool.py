"""BlockPool and FreeBlockQueue: O(1) queue operations, ref counts, prefix hits
verified by tokens and salt identity, LRU eviction with events."""

import time

from splitserve.common.hashing import hash_blocks, salt_id
from splitserve.common.prompt_ref import PromptKeys
from splitserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from splitserve.engine.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock


SALT = salt_id(PromptKeys(model="test-model").hash_keys())


def make_pool(num_blocks: int = 8, enable_caching: bool = True) -> BlockPool:
    return BlockPool(num_blocks, enable_caching=enable_caching)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def check_queue_links(q: FreeBlockQueue) -> None:
    items = list(q)
    assert len(items) == len(q)
    for a, b in zip(items, items[1:]):
        assert a.next_free is b and b.prev_free is a


def test_free_queue_order_and_remove():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # middle
    assert blocks[2] not in q and blocks[2].prev_free is None and blocks[2].next_free is None
    q.remove(blocks[0])  # head
    q.remove(blocks[4])  # tail
    assert ids(q) == [1, 3] and len(q) == 2
    check_queue_links(q)
    q.append(blocks[0])
    q.append(blocks[2])
    assert ids(q) == [1, 3, 0, 2]
    assert q.popleft() is blocks[1]
    assert q.popleft() is blocks[3]
    assert ids(q) == [0, 2] and len(q) == 2
    check_queue_links(q)
    q.popleft(), q.popleft()
    assert len(q) == 0 and list(q) == []
    q.append(blocks[4])
    assert ids(q) == [4]


def test_free_queue_operations_are_constant_time():
    # remove() of a middle block and popleft() must not scan the list: timing a
    # 200k-block queue against a 2k-block one catches an O(n) implementation.
    def run(n: int) -> float:
        blocks = [KVBlock(i) for i in range(n)]
        q = FreeBlockQueue(blocks)
        mid = blocks[n // 2 : n // 2 + 1000]
        t0 = time.perf_counter()
        for b in mid:
            q.remove(b)
        for b in mid:
            q.append(b)
        for _ in range(1000):
            q.append(q.popleft())
        return time.perf_counter() - t0

    small = min(run(2_000) for _ in range(3))
    large = min(run(200_000) for _ in range(3))
    assert large < small * 10 + 0.005, (small, large)


def test_new_blocks_refcount_and_usage():
    pool = make_pool(4)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    pool.free_blocks(a)
    assert pool.num_free_blocks == 4 and all(b.ref_cnt == 0 for b in a)
    # Freed blocks went to the tail in the given order, after the never-used block 3.
    assert ids(pool.free_queue) == [3, 0, 1, 2]
    assert pool.take_events() == []  # nothing cached, nothing recorded


def test_prefix_hit_verified_by_tokens():
    pool = make_pool(4)
    tokens = [11, 12, 13, 14]
    (h,) = hash_blocks(tokens, 4)
    (blk,) = pool.get_new_blocks(1)
    assert pool.cache_block(blk, h, None, tokens, SALT)
    assert pool.get_cached_block(h, tokens, SALT) is blk
    assert pool.get_cached_block(h, [11, 12, 13, 15], SALT) is None  # collision: not a hit
    assert pool.get_cached_block(h + 1, tokens, SALT) is None
    # A forged map entry whose block holds other tokens is not a hit either.
    forged_hash = hash_blocks([1, 2, 3, 4], 4)[0]
    pool.cached[forged_hash] = blk
    assert pool.get_cached_block(forged_hash, [1, 2, 3, 4], SALT) is None
    del pool.cached[forged_hash]


def test_a_block_of_another_salt_is_not_a_hit_under_the_same_hash_and_tokens():
    pool = make_pool(4)
    tokens = [11, 12, 13, 14]
    (h,) = hash_blocks(tokens, 4)  # forced equal for both salts
    salt_a, salt_b = salt_id(PromptKeys(model="m", cache_salt="tenant-a").hash_keys()), salt_id(PromptKeys(model="m", cache_salt="tenant-b").hash_keys())
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, h, None, tokens, salt_a)
    assert pool.get_cached_block(h, tokens, salt_b) is None
    assert not pool.cache_block(b, h, None, tokens, salt_b)  # a holds the hash: b stays uncached
    assert pool.get_cached_block(h, tokens, salt_a) is a  # the same salt still shares
    pool.free_blocks([a, b])
    evicted = []

    class Lower:  # block_pool.LowerTiers: what a lower tier learns of an eviction
        def cached(self, block_id, bh, toks, salt): pass
        def store(self, block_id, bh, toks, salt): evicted.append((block_id, bh, toks, salt))

    pool.get_new_blocks(4, Lower())
    assert evicted == [(a.block_id, h, tuple(tokens), salt_a)]  # a lower tier learns the salt too
    assert a.salt is None


def test_touch_takes_cached_free_block_out_of_queue():
    pool = make_pool(3)
    tokens = [1, 2, 3, 4]
    (h,) = hash_blocks(tokens, 4)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_block(blk, h, None, tokens, SALT)
    pool.free_blocks([blk])
    assert blk in pool.free_queue and pool.num_free_blocks == 3
    hit = pool.get_cached_block(h, tokens, SALT)
    assert hit is blk and blk.ref_cnt == 0  # lookup does not take a reference
    pool.touch([hit])
    assert blk.ref_cnt == 1 and blk not in pool.free_queue and pool.num_free_blocks == 2
    pool.touch([hit])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and blk not in pool.free_queue
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and ids(pool.free_queue)[-1] == blk.block_id
    assert pool.get_cached_block(h, tokens, SALT) is blk  # still cached while free


def test_lru_eviction_order_with_removed_events():
    pool = make_pool(4)
    chain = list(range(100, 116))
    hashes = hash_blocks(chain, 4)
    blocks = pool.get_new_blocks(4)
    parent = None
    for blk, h, i in zip(blocks, hashes, range(4)):
        pool.cache_block(blk, h, parent, chain[i * 4 : (i + 1) * 4], SALT)
        parent = h
    # One batched store event for the whole chain.
    assert pool.take_events() == [
        BlockStored(block_hashes=hashes)
    ]
    # Free tail first (as the manager does): blocks 3, 2, 1, 0 -> evicted in that order.
    pool.free_blocks(reversed(blocks))
    assert ids(pool.free_queue) == [3, 2, 1, 0]
    got = pool.get_new_blocks(2)
    assert ids(got) == [3, 2]
    assert all(b.block_hash is None and b.token_ids is None for b in got)
    assert pool.take_events() == [BlockRemoved(block_hashes=[hashes[3], hashes[2]])]
    assert set(pool.cached) == {hashes[0], hashes[1]}
    # The surviving prefix is still a hit and can be re-referenced.
    assert pool.get_cached_block(hashes[0], chain[:4], SALT) is blocks[0]
    pool.touch([blocks[0]])
    got2 = pool.get_new_blocks(1)
    assert ids(got2) == [1]  # block 0 is in use, block 1 is the only free one
    assert pool.take_events() == [BlockRemoved(block_hashes=[hashes[1]])]
    assert pool.num_free_blocks == 0


def test_duplicate_hash_keeps_first_block_and_records_once():
    pool = make_pool(4)
    tokens = [5, 6, 7, 8]
    (h,) = hash_blocks(tokens, 4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, h, None, tokens, SALT)
    assert not pool.cache_block(b, h, None, tokens, SALT)
    assert pool.cached[h] is a and b.block_hash is None
    assert pool.cache_block(a, h, None, tokens, SALT)  # re-caching under its own hash: no-op
    events = pool.take_events()
    assert len(events) == 1 and events[0].block_hashes == [h]


def test_store_events_batch_only_consecutive_chains():
    pool = make_pool(4)
    x = hash_blocks(list(range(8)), 4)
    y = hash_blocks(list(range(50, 54)), 4)
    b0, b1, b2 = pool.get_new_blocks(3)
    pool.cache_block(b0, x[0], None, range(4), SALT)
    pool.cache_block(b2, y[0], None, range(50, 54), SALT)  # another chain: new event
    pool.cache_block(b1, x[1], x[0], range(4, 8), SALT)  # parent is not y[0]: new event
    ev = pool.take_events()
    assert [e.block_hashes for e in ev] == [[x[0]], [y[0]], [x[1]]]
    assert pool.take_events() == []  # drained


def test_reset_prefix_cache():
    pool = make_pool(2)
    (h,) = hash_blocks([1, 2], 2)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_block(blk, h, None, [1, 2], SALT)
    assert pool.reset_prefix_cache() is False  # a block is in use
    assert pool.cached == {h: blk}
    pool.free_blocks([blk])
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and blk.block_hash is None and blk.token_ids is None
    assert pool.take_events() == [AllBlocksCleared()]
    # Reused after a reset: no BlockRemoved for a hash already cleared.
    pool.get_new_blocks(2)
    assert pool.take_events() == []


def test_caching_disabled_has_no_map_and_no_events():
    pool = make_pool(2, enable_caching=False)
    (h,) = hash_blocks([1, 2], 2)
    (blk,) = pool.get_new_blocks(1)
    assert pool.cache_block(blk, h, None, [1, 2], SALT) is False
    assert pool.get_cached_block(h, [1, 2], SALT) is None
    pool.free_blocks([blk])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and pool.take_events() == []
