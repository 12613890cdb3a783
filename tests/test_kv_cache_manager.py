"""KVCacheManager: prefix hits (checked against tokens and salt identity), allocation as
requests grow, caching, freeing, and a randomized run checking the pool's invariants after
every operation."""

import random

from splitserve.common.hashing import extend_block_hashes, hash_blocks, salt_id
from splitserve.common.kv_events import BlockRemoved, BlockStored
from splitserve.engine.kv.cache_manager import ComputedBlocks, KVCacheManager

BS = 4
MODEL = ("test-model",)
SALT = salt_id(MODEL)


def make_manager(num_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)


def prefill(m: KVCacheManager, req_id: str, prompt: list[int]) -> ComputedBlocks | None:
    """Admit, allocate and fully compute ``prompt``, the way a scheduler would."""
    hashes = hash_blocks(prompt, BS, MODEL)
    computed = m.get_computed_blocks(hashes, prompt, SALT)
    if m.allocate_slots(req_id, len(prompt), computed.blocks) is None:
        return None
    m.cache_blocks(req_id, hashes, prompt, len(prompt), SALT)
    return computed


def check_invariants(m: KVCacheManager) -> None:
    pool = m.pool
    owners: dict[int, int] = {}  # block_id -> number of requests holding it
    for blocks in m._req_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks)  # no block twice in a request
        for b in blocks:
            owners[b.block_id] = owners.get(b.block_id, 0) + 1
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    for b in pool.blocks:
        if b.ref_cnt == 0:
            assert b in pool.free_queue and b.block_id not in owners
        else:
            assert b not in pool.free_queue and owners.get(b.block_id) == b.ref_cnt
    assert len(free_ids) + len(owners) == pool.num_blocks
    for h, b in pool.cached.items():
        assert b.block_hash == h and b.token_ids is not None and len(b.token_ids) == BS
    for b in pool.blocks:
        if b.block_hash is not None:
            assert pool.cached[b.block_hash] is b
    for req_id, blocks in m._req_blocks.items():
        assert m._num_cached[req_id] <= len(blocks)


def test_first_allocation_and_growth():
    m = make_manager(8)
    assert m.num_blocks_needed("a", 9) == 3
    new = m.allocate_slots("a", 9)
    assert new is not None and len(new) == 3 and m.block_ids("a") == [b.block_id for b in new]
    assert m.num_blocks_needed("a", 12) == 0
    assert m.allocate_slots("a", 12) == []  # still fits in 3 blocks
    assert m.num_blocks_needed("a", 13) == 1
    grown = m.allocate_slots("a", 13)
    assert grown is not None and len(grown) == 1
    assert len(m.block_ids("a")) == 4 and m.num_free_blocks == 4
    m.free("a")
    m.free("a")  # idempotent
    assert m.num_free_blocks == 8 and "a" not in m


def test_shared_prefix_uses_same_blocks():
    m = make_manager(16)
    system = list(range(500, 512))  # 3 full blocks
    prompt_a = system + [1, 2, 3]
    prompt_b = system + [7, 8, 9, 10, 11]
    assert prefill(m, "a", prompt_a).num_tokens == 0
    computed = prefill(m, "b", prompt_b)
    assert computed.num_tokens == 12 and len(computed.blocks) == 3
    assert m.block_ids("a")[:3] == m.block_ids("b")[:3]
    assert m.block_ids("a")[3] != m.block_ids("b")[3]
    for b in computed.blocks:
        assert b.ref_cnt == 2
    check_invariants(m)
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == 16 and all(b.ref_cnt == 0 for b in m.pool.blocks)
    check_invariants(m)


def test_whole_prompt_cached_leaves_last_token_to_compute():
    m = make_manager(16)
    prompt = list(range(8))  # exactly 2 full blocks
    prefill(m, "a", prompt)
    hashes = hash_blocks(prompt, BS, MODEL)
    assert len(hashes) == 2 and all(h in m.pool.cached for h in hashes)
    computed = m.get_computed_blocks(hashes, prompt, SALT)
    assert len(computed.blocks) == 1 and computed.num_tokens == 4  # t4..t7 recomputed
    longer = prompt + [99]
    computed = m.get_computed_blocks(hash_blocks(longer, BS, MODEL), longer, SALT)
    assert computed.num_tokens == 8  # only t8 to compute
    assert m.get_computed_blocks([], [], SALT) == ComputedBlocks([], 0)
    one_block = prompt[:4]
    assert m.get_computed_blocks(hashes[:1], one_block, SALT).num_tokens == 0


def test_prefix_hit_stops_at_first_miss_and_checks_tokens():
    m = make_manager(16)
    prompt = list(range(20))
    prefill(m, "a", prompt)
    other = list(range(8)) + [77, 9, 10, 11] + list(range(12, 20))
    computed = m.get_computed_blocks(hash_blocks(other, BS, MODEL), other, SALT)
    assert computed.num_tokens == 8  # block 2 differs, later blocks are not hits
    # Right hashes, wrong tokens (a forged or colliding hash list): no hit.
    hashes = hash_blocks(prompt, BS, MODEL)
    forged = [999] + prompt[1:]
    assert m.get_computed_blocks(hashes, forged, SALT).num_tokens == 0
    # Another model's hashes (different extra keys) do not hit.
    assert m.get_computed_blocks(hash_blocks(prompt, BS, ("other",)), prompt, salt_id(("other",))).num_tokens == 0
    # Nor do the right hashes and tokens of another salt (a forged or colliding hash list).
    assert m.get_computed_blocks(hashes, prompt, salt_id(("other",))).num_tokens == 0
    assert m.get_computed_blocks(hashes, prompt, SALT).num_tokens == 16


def test_allocate_returns_none_without_state_change():
    m = make_manager(6)
    prompt = list(range(12))  # 3 blocks
    prefill(m, "a", prompt)
    m.free("a")  # queue: [3, 4, 5 | 2, 1, 0], the last three cached and evictable
    m.allocate_slots("hog", 8)  # takes never-used blocks 3 and 4
    assert m.num_free_blocks == 4
    queue_before = [b.block_id for b in m.pool.free_queue]
    refs_before = [b.ref_cnt for b in m.pool.blocks]
    cached_before = dict(m.pool.cached)
    m.take_events()

    # "b" shares 2 blocks of the prefix; both are at ref_cnt 0 and must leave the
    # free queue when touched, so 4 free blocks are not enough for 2 + 3 new ones.
    prompt_b = prompt[:8] + list(range(100, 112))  # 20 tokens -> 5 blocks
    computed = m.get_computed_blocks(hash_blocks(prompt_b, BS, MODEL), prompt_b, SALT)
    assert len(computed.blocks) == 2
    assert m.num_blocks_needed("b", 20, computed.blocks) == 5
    assert m.allocate_slots("b", 20, computed.blocks) is None
    assert "b" not in m
    assert [b.block_id for b in m.pool.free_queue] == queue_before
    assert [b.ref_cnt for b in m.pool.blocks] == refs_before
    assert m.pool.cached == cached_before and m.take_events() == []
    # Growing an existing request past the pool is refused the same way.
    assert m.allocate_slots("hog", 8 + 5 * BS) is None
    assert len(m.block_ids("hog")) == 2
    # With 16 tokens it fits: 2 touched + 2 new.
    new = m.allocate_slots("b", 16, computed.blocks)
    assert new is not None and len(new) == 2 and m.num_free_blocks == 0
    check_invariants(m)


def test_cache_blocks_incremental_during_decode():
    m = make_manager(16)
    tokens = list(range(6))
    hashes = hash_blocks(tokens, BS, MODEL)
    m.allocate_slots("a", len(tokens))
    m.cache_blocks("a", hashes, tokens, len(tokens), SALT)
    assert m.take_events() == [
        BlockStored(block_hashes=hashes)
    ]
    for t in range(6, 13):  # decode one token at a time
        tokens.append(1000 + t)
        assert m.allocate_slots("a", len(tokens)) is not None
        extend_block_hashes(hashes, tokens, BS, MODEL)
        m.cache_blocks("a", hashes, tokens, len(tokens), SALT)
    m.cache_blocks("a", hashes, tokens, len(tokens), SALT)  # idempotent
    assert hashes == hash_blocks(tokens, BS, MODEL) and len(hashes) == 3
    ev = m.take_events()
    assert ev == [
        BlockStored(block_hashes=hashes[1:3])
    ]
    blocks = m._req_blocks["a"]
    assert [b.block_hash for b in blocks] == hashes + [None]  # partial block uncached


def test_free_evicts_tail_before_shared_prefix():
    m = make_manager(8)
    prompt = list(range(16))
    prefill(m, "a", prompt)
    ids_a = m.block_ids("a")
    m.free("a")
    assert [b.block_id for b in m.pool.free_queue][-4:] == ids_a[::-1]
    m.take_events()
    m.allocate_slots("x", 4 * 6)  # 4 never-used blocks, then evicts 2 from a's tail
    hashes = hash_blocks(prompt, BS, MODEL)
    assert m.take_events() == [BlockRemoved(block_hashes=[hashes[3], hashes[2]])]
    computed = m.get_computed_blocks(hashes, prompt + [0], SALT)
    assert [b.block_id for b in computed.blocks] == ids_a[:2]


def test_prefix_caching_disabled():
    m = make_manager(8, caching=False)
    prompt = list(range(12))
    prefill(m, "a", prompt)
    assert prefill(m, "b", prompt).num_tokens == 0
    assert set(m.block_ids("a")).isdisjoint(m.block_ids("b"))
    assert m.take_events() == [] and m.pool.cached == {}
    m.free("a"), m.free("b")
    assert m.num_free_blocks == 8


def test_randomized_alloc_cache_free_keeps_invariants():
    rng = random.Random(1234)
    m = make_manager(40)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(4)]
    live: dict[str, tuple[list[int], list[int], int]] = {}  # req_id -> (tokens, hashes, computed)
    next_id = 0
    stored: set[int] = set()  # hashes the event stream says are cached
    for step in range(3000):
        op = rng.random()
        if op < 0.35 or not live:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 14))]
            hashes = hash_blocks(prompt, BS, MODEL)
            computed = m.get_computed_blocks(hashes, prompt, SALT)
            assert computed.num_tokens < len(prompt)
            req_id = f"r{next_id}"
            next_id += 1
            need = m.num_blocks_needed(req_id, len(prompt), computed.blocks)
            fits = need <= m.num_free_blocks
            new = m.allocate_slots(req_id, len(prompt), computed.blocks)
            assert (new is not None) == fits
            if new is not None:
                assert len(m.block_ids(req_id)) == -(-len(prompt) // BS)
                live[req_id] = (prompt, hashes, computed.num_tokens)
        elif op < 0.75:
            req_id = rng.choice(sorted(live))
            tokens, hashes, done = live[req_id]
            if done < len(tokens):  # compute a chunk of the prompt
                done = min(len(tokens), done + rng.randrange(1, 9))
            else:  # decode one token
                if m.allocate_slots(req_id, len(tokens) + 1) is None:
                    continue
                tokens.append(rng.randrange(50))
                extend_block_hashes(hashes, tokens, BS, MODEL)
                done = len(tokens)
            m.cache_blocks(req_id, hashes, tokens, done, SALT)
            live[req_id] = (tokens, hashes, done)
        else:
            req_id = rng.choice(sorted(live))
            m.free(req_id)
            del live[req_id]
        for ev in m.take_events():
            if isinstance(ev, BlockStored):
                assert not stored & set(ev.block_hashes)
                stored.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= stored
                stored.difference_update(ev.block_hashes)
            else:
                stored.clear()
        assert stored == set(m.pool.cached)
        check_invariants(m)
        if step % 250 == 0:  # a reset succeeds iff no request holds blocks
            assert m.reset_prefix_cache() == (not live)
    assert next_id > 500 and m.pool.cached
    for req_id in list(live):
        m.free(req_id)
    assert m.num_free_blocks == m.num_blocks
    assert all(b.ref_cnt == 0 for b in m.pool.blocks)
    check_invariants(m)
    assert m.reset_prefix_cache() and m.pool.cached == {}


def test_engine_shares_blocks_only_within_a_cache_salt(make_engine):
    """The engine hashes every block of a request (prompt and decoded) with its cache salt:
    the same prompt under another salt, or none, gets no prefix hit, its own salt does, and
    the prefix-cache events (what the index and every router's mirror learn) carry the
    salted hashes; a reservation (the decode node's side of a transfer) finds them likewise."""
    from splitserve.common.prompt_ref import PromptKeys
    from splitserve.common.sampling_params import SamplingParams

    engine = make_engine(block_size=16, kv_cache_memory=16 << 20)
    prompt = list(range(100, 100 + 4 * 16 + 5))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    model = engine.config.model_id

    def run(rid: str, salt: str | None) -> int:
        engine.add_request(rid, engine.prompt_ref(prompt, cache_salt=salt), params)
        cached = None
        while engine.has_unfinished():
            for d in engine.step():
                if d.request_id == rid and cached is None:
                    cached = d.num_cached_tokens
        return cached

    engine.kv.take_events()
    assert run("a1", "tenant-a") == 0
    stored = {h for e in engine.kv.take_events() if isinstance(e, BlockStored) for h in e.block_hashes}
    salted = hash_blocks(prompt + [0] * 20, 16, PromptKeys(model=model, cache_salt="tenant-a").hash_keys())  # tokens beyond the prompt vary
    assert set(salted[:4]) <= stored  # the prompt's full blocks, under the salted hashes
    assert not stored & set(hash_blocks(prompt, 16, (model,)))  # never the unsalted ones
    assert run("b1", "tenant-b") == 0  # another tenant, same prompt: no hit
    assert run("u1", None) == 0  # nor the unsalted cache
    assert run("a2", "tenant-a") == 4 * 16  # its own salt: every full prompt block
    assert run("b2", "tenant-b") == 4 * 16
    hit = engine.reserve("r-a", engine.prompt_ref(prompt, cache_salt="tenant-a"))
    miss = engine.reserve("r-c", engine.prompt_ref(prompt, cache_salt="tenant-c"))
    assert hit is not None and miss is not None
    assert hit.num_cached_tokens == 4 * 16 and miss.num_cached_tokens == 0
    engine.release("r-a")
    engine.release("r-c")
