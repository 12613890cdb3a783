"""Batched prefill: chunks packed into one attention call (block-diagonal causal mask
over their cached context) equal the per-chunk path and a plain softmax reference,
and the engine's greedy tokens do not depend on how chunks are packed."""

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import model_runner
from splitserve.engine.attention import prefill_batch
from splitserve.engine.attention.base import AttentionMetadata
from splitserve.engine.attention.prefill_batch import ChunkSpec, build_prefill_groups
from splitserve.engine.attention.torch_backend import TorchAttention

BS, KV_HEADS, HEADS, HD = 4, 2, 4, 8


def make_step(chunk_shapes, seed=0):
    """chunk_shapes: [(ctx_len, q_len)] -> (q, k, v, kv_cache, chunks): each chunk's context
    already in its own blocks of the cache, its new tokens' K/V in k, v."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // BS) for c, n in chunk_shapes) + 1
    kv_cache = torch.randn(2, num_blocks, BS, KV_HEADS, HD, generator=g)
    total_q = sum(n for _, n in chunk_shapes)
    q = torch.randn(total_q, HEADS, HD, generator=g)
    k = torch.randn(total_q, KV_HEADS, HD, generator=g)
    v = torch.randn(total_q, KV_HEADS, HD, generator=g)
    blocks = torch.randperm(num_blocks, generator=g).tolist()  # scattered, not in order
    chunks, row = [], 0
    for ctx, n in chunk_shapes:
        table = torch.tensor([blocks.pop() for _ in range(-(-(ctx + n) // BS))])
        pos = torch.arange(ctx + n)
        chunks.append(ChunkSpec(row, n, ctx, table[pos // BS] * BS + pos % BS))
        row += n
    return q, k, v, kv_cache, chunks


def run(q, k, v, kv_cache, chunks, groups):
    meta = AttentionMetadata(slot_mapping=torch.cat([c.key_slots[c.ctx_len:] for c in chunks]), num_decodes=0,
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.long),
                             decode_seq_lens=torch.zeros(0, dtype=torch.long), decode_mask=None, prefills=groups)
    cache = kv_cache.clone()
    return TorchAttention().forward(q, k, v, cache, meta).view(q.shape), cache


def reference(q, k, v, kv_cache, chunks):
    """Each chunk alone, explicit softmax over its context + itself, in float64."""
    out = torch.empty_like(q, dtype=torch.float64)
    flat_k = kv_cache[0].reshape(-1, KV_HEADS, HD).clone()
    flat_v = kv_cache[1].reshape(-1, KV_HEADS, HD).clone()
    for c in chunks:
        new = c.key_slots[c.ctx_len:]
        flat_k[new], flat_v[new] = k[c.q_start:c.q_start + c.q_len], v[c.q_start:c.q_start + c.q_len]
    for c in chunks:
        keys, vals = flat_k[c.key_slots].double(), flat_v[c.key_slots].double()  # [ctx + n, kv, hd]
        for j in range(c.q_len):
            visible = c.ctx_len + j + 1
            for h in range(HEADS):
                kv_h = h // (HEADS // KV_HEADS)
                scores = keys[:visible, kv_h] @ q[c.q_start + j, h].double() / HD ** 0.5
                out[c.q_start + j, h] = scores.softmax(0) @ vals[:visible, kv_h]
    return out


SHAPES = [(0, 5), (6, 3), (0, 1), (9, 7), (3, 2)]  # (cached context, new tokens): fresh and continued chunks


def test_packed_group_equals_per_chunk_and_reference(monkeypatch):
    q, k, v, kv_cache, chunks = make_step(SHAPES)
    monkeypatch.setattr(prefill_batch, "MAX_DENSE_RATIO", float("inf"))
    packed = build_prefill_groups(chunks, torch.device("cpu"), varlen=False)
    assert len(packed) == 1 and packed[0].mask.shape == (18, sum(c + n for c, n in SHAPES))
    out_packed, cache_packed = run(q, k, v, kv_cache, chunks, packed)

    per_chunk = [g for c in chunks for g in build_prefill_groups([c], torch.device("cpu"), varlen=False)]
    assert len(per_chunk) == len(chunks)
    out_single, cache_single = run(q, k, v, kv_cache, chunks, per_chunk)

    ref = reference(q, k, v, kv_cache, chunks)
    torch.testing.assert_close(out_packed.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_single.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache_packed, cache_single)


def test_grouping_bounds_the_masked_waste():
    cpu = torch.device("cpu")
    lone = build_prefill_groups(make_step([(0, 8)])[4], cpu, varlen=False)
    assert len(lone) == 1 and lone[0].key_slots is None and lone[0].mask is None  # is_causal on fresh K/V
    pair = build_prefill_groups(make_step([(0, 8), (0, 8)])[4], cpu, varlen=False)
    assert len(pair) == 1 and pair[0].q_len == 16  # dense 16 x 16 = 2x the useful 2 x 8 x 8
    three = build_prefill_groups(make_step([(0, 8), (0, 8), (0, 8)])[4], cpu, varlen=False)
    assert [g.q_len for g in three] == [16, 8]
    # varlen packs everything, with offsets instead of a mask
    varlen = build_prefill_groups(make_step(SHAPES)[4], cpu, varlen=True)
    assert len(varlen) == 1 and varlen[0].mask is None
    assert varlen[0].cu_q.tolist() == [0, 5, 8, 9, 16, 18]
    assert varlen[0].cu_k.tolist() == [0, 5, 14, 15, 31, 36]
    assert (varlen[0].max_q, varlen[0].max_k) == (7, 16)


@pytest.mark.slow
def test_engine_greedy_tokens_do_not_depend_on_packing(make_engine, run_engine, tokenizer, monkeypatch):
    """Same schedule (chunks of 24 with cached context, requests joining mid-run), chunks
    packed into one call per step vs one call per chunk: same greedy tokens."""
    prefix = tokenizer("The quarterly report covers revenue, costs, hiring and the outlook for next year. " * 2)[
        "input_ids"]
    prompts = {f"r{i}": prefix + tokenizer(f" Summarize section {i} in one line.")["input_ids"] for i in range(5)}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = {rid: (ids, params) for rid, ids in prompts.items()}
    join_at = {"r3": 2, "r4": 5}

    widest = []  # per run: the most chunks one attention call computed

    def spy(chunks, device, varlen):
        groups = build_prefill_groups(chunks, device, varlen)
        widest[-1] = max(widest[-1], len(chunks) - len(groups) + 1)
        return groups

    monkeypatch.setattr(model_runner, "build_prefill_groups", spy)
    outputs = []
    for ratio in (float("inf"), 1.0):  # everything packed | one chunk per call
        monkeypatch.setattr(prefill_batch, "MAX_DENSE_RATIO", ratio)
        widest.append(0)
        engine = make_engine(prefill_chunk_size=24, max_num_batched_tokens=96, enable_prefix_caching=False,
                             num_threads=1)
        outputs.append(run_engine(engine, requests, join_at))
    assert widest[0] >= 3 and widest[1] == 1
    assert outputs[0] == outputs[1]
    assert all(len(t) == 8 for t in outputs[0].values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_varlen_flash_equals_masked_sdpa_on_cuda():
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev) < (8, 0):
        pytest.skip("torch's varlen flash attention needs an Ampere or newer GPU")
    # else the engine's prefill must get it (model_runner.prefill_varlen), not fall back to masked groups
    assert prefill_batch.varlen_available(dev, torch.bfloat16), "varlen flash attention unavailable (see the log)"
    q, k, v, kv_cache, chunks = make_step(SHAPES)
    q, k, v, kv_cache = (t.to(dev, torch.bfloat16) for t in (q, k, v, kv_cache))
    chunks = [c._replace(key_slots=c.key_slots) for c in chunks]
    varlen = build_prefill_groups(chunks, dev, varlen=True)
    masked = [g for c in chunks for g in build_prefill_groups([c], dev, varlen=False)]
    out_v, _ = run(q, k, v, kv_cache, chunks, varlen)
    out_m, _ = run(q, k, v, kv_cache, chunks, masked)
    torch.testing.assert_close(out_v.float(), out_m.float(), rtol=2e-2, atol=2e-2)
