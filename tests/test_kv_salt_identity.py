"""Blocks of two cache salts are told apart by more than their 64-bit hash: every tier (the
device block pool, the host tier, the disk tier's files) keeps the salt identity of the
request that cached a block (common/hashing.py ``salt_id``) and a hit must match it with the
block's tokens.

The hashes are forced equal the way a node would take them from a request (the engine's
``add_request(block_hashes=...)``): tenant b's request carries tenant a's hashes for the same
tokens. It gets no cached token from a's blocks on any tier, while a's own repeat does. A
KVCacheManager over the three tiers is also checked directly with one hash list and two
salts (the block pool alone: test_block_pool.py; a disk file: test_kv_disk_tier_faults.py).
"""

import time

import numpy as np
import pytest
import torch

from splitserve.common.hashing import hash_blocks, salt_id
from splitserve.common.kv_events import Tier
from splitserve.common.prompt_ref import PromptKeys, PromptRef
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.kv.cache_manager import KVCacheManager
from splitserve.engine.kv.disk_tier import DiskLayout, DiskTier
from splitserve.engine.kv.tier_spec import TierSpec

BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # bytes of the tiny Llama's block: 2 layers, K and V, 16 tokens, 2 KV heads of 16, fp32
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SALT_A = salt_id(PromptKeys(model="m", cache_salt="a").hash_keys())
SALT_B = salt_id(PromptKeys(model="m", cache_salt="b").hash_keys())


def prompts():
    """Three unrelated prompts of 6 full blocks each (and 4 tokens): each evicts the one
    before from 8 device blocks."""
    return [[(7 * i + 13 * j + 1) % 250 + 1 for j in range(100)] for i in range(3)]


@pytest.fixture(scope="module")
def tiny(shared_tiny_model):
    return shared_tiny_model("llama", max_position_embeddings=512)


def tiny_llm(model_dir, blocks, **kw):
    from splitserve.engine.llm import LLM
    return LLM(str(model_dir), kv_cache_memory=blocks * BLOCK, max_num_seqs=4, **kw)


def serve(engine, rid: str, prompt: list[int], salt: str, hashes: list[int] | None = None) -> tuple[list[int], int]:
    """Run one request to its end on ``engine``: (its tokens, its cached prompt tokens)."""
    ref = PromptRef(prompt, PromptKeys(model=engine.config.model_id, cache_salt=salt), engine.config.block_size,
                    None if hashes is None else np.array(hashes, dtype=np.uint64))  # given hashes, whoever's
    engine.add_request(rid, ref, PARAMS)
    tokens, cached, reason = [], -1, None
    while engine.has_unfinished():
        for d in engine.step():
            tokens += d.new_token_ids
            cached, reason = d.num_cached_tokens, d.finish_reason or reason
    assert reason == "length", f"{rid} finished with {reason}"
    return tokens, cached


def a_then_b(engine, model_id: str, push_down: list[int], tier: Tier) -> tuple[int, int]:
    """Tenant a serves prompt 0 twice with prompts ``push_down`` between, then tenant b sends
    prompt 0 with a's hashes while ``tier`` holds a's blocks: (a's repeat's cached tokens, b's)."""
    ps = prompts()
    hashes_a = hash_blocks(ps[0], 16, PromptKeys(model=model_id, cache_salt="a").hash_keys())
    want, _ = serve(engine, "a0", ps[0], "a")
    for i in push_down:
        serve(engine, f"a{i}", ps[i], "a")
    again, cached_a = serve(engine, "a0-again", ps[0], "a", hashes_a)
    for i in push_down:
        serve(engine, f"a{i}-again", ps[i], "a")
    if engine.kv.tiers is not None and engine.kv.tiers.disk is not None:
        disk = engine.kv.tiers.disk
        deadline = time.monotonic() + 10
        while not all(disk.contains(h) for h in hashes_a[:4]) and time.monotonic() < deadline:
            time.sleep(0.02)  # the writer stores prompt 0's blocks
    held = engine.kv.held_blocks()
    assert [held.get(h) for h in hashes_a[:4]] == [tier] * 4
    got, cached_b = serve(engine, "b0", ps[0], "b", hashes_a)
    assert again == got == want  # the same model: the salt changes no token
    return cached_a, cached_b


def test_device_blocks_of_another_salt_are_not_hits_even_under_the_same_hash(tiny):
    with tiny_llm(tiny, 64) as llm:
        assert a_then_b(llm.engine, llm.engine.config.model_id, [], Tier.DEVICE) == (96, 0)


def test_host_blocks_of_another_salt_are_not_hits_even_under_the_same_hash(tiny):
    with tiny_llm(tiny, 8, kv_offload_memory=32 * BLOCK) as llm:
        assert a_then_b(llm.engine, llm.engine.config.model_id, [1, 2], Tier.HOST) == (96, 0)


def test_disk_blocks_of_another_salt_are_not_hits_even_under_the_same_hash(tiny, tmp_path):
    with tiny_llm(tiny, 8, kv_offload_memory=2 * BLOCK, kv_offload_dir=str(tmp_path),
                  kv_offload_disk_bytes=1 << 20) as llm:
        assert a_then_b(llm.engine, llm.engine.config.model_id, [1, 2], Tier.DISK) == (96, 0)


def test_one_hash_list_and_two_salts_share_no_block_on_any_tier(tmp_path):
    bs = 4
    kv = torch.zeros((2, 2, 3, bs, 1, 2))  # [layers, K/V, blocks, block size, KV heads, head dim]
    disk = DiskTier(tmp_path, DiskLayout("m", "float32", (2, 2, bs, 1, 2)), kv[:, :, 0].numel() * 4, 64 << 10,
                    bytes(range(32)))
    mgr = KVCacheManager(3, bs, True, TierSpec(kv, 2, disk))
    tokens = list(range(8)) + [1]  # 2 full blocks: the ninth token is never a hit
    hashes = [11, 12]  # forced: the same for both salts

    def fill(rid: str, toks: list[int], hs: list[int], salt: bytes) -> None:
        hit = mgr.get_computed_blocks(hs, toks, salt)
        assert mgr.allocate_slots(rid, len(toks), hit.blocks, hit.lower) is not None
        mgr.cache_blocks(rid, hs, toks, len(toks), salt)
        mgr.free(rid)

    def hits(salt: bytes) -> tuple[int, list[Tier]]:
        """(device hits, the tiers of the lower hits) of ``tokens`` under ``hashes``."""
        hit = mgr.get_computed_blocks(hashes, tokens, salt)
        return len(hit.blocks), [h.tier for h in hit.lower]

    fill("a", tokens, hashes, SALT_A)
    assert hits(SALT_B) == (0, []) and hits(SALT_A) == (2, [])
    fill("x", list(range(20, 28)) + [1], [21, 22], SALT_A)  # a's 2 blocks -> host
    assert hits(SALT_B) == (0, []) and hits(SALT_A) == (0, [Tier.HOST, Tier.HOST])
    fill("y", list(range(40, 48)) + [1], [41, 42], SALT_A)  # x's -> host, a's -> disk
    deadline = time.monotonic() + 10
    while not (disk.contains(11) and disk.contains(12)) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert hits(SALT_B) == (0, []) and hits(SALT_A) == (0, [Tier.DISK, Tier.DISK])  # b's miss kept a's files
    disk.close()
