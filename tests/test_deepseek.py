"""The DeepSeek-V3 family (engine/models/deepseek.py): Multi-head Latent Attention over a latent
KV cache (engine/models/mla.py) and DeepSeekMoE (sigmoid router with score bias, expert
groups and routed scaling; a shared expert; a first dense layer), on tiny random models
that transformers builds (fp32, CPU).

- Greedy tokens equal transformers' generate: q LoRA or a full q projection, default RoPE or
  YaRN, interleaved rotary pairs or halves; parameter counts equal transformers'.
- Absorbed (decode) and plain (prefill) attention over the same cached latents agree within
  1e-5 (fp32); a decode step's tokens therefore follow the prefill's.
- The cache holds one latent per token and layer: bytes per token = layers x (kv_lora_rank +
  qk_rope_head_dim) x itemsize, measured on the engine's cache, beside the GQA a same-size
  Llama needs.
- Through router -> prefill -> decode (real processes, Redis): transformers' tokens, the
  latent blocks sent (0 fallback prefills), the nodes' KV key naming the latent width.
- Refusals name the field: TP > 1, FP8 checkpoints, DeepSeek-V2's routers, an odd latent.
"""

import json
import os
import urllib.request

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.attention.base import PrefillGroup
from splitserve.engine.models.loader import load_model
from splitserve.engine.models.mla import MLAttention
from splitserve.engine.models.families import family_of, model_config, read_model_config
from splitserve.engine.models.sharding import check_model_tp
from splitserve.tests.served_cluster import assert_serves_greedy

os.environ.setdefault("SPLITSERVE_QUIET", "1")

PROMPTS = [[5, 17, 42, 99, 3, 8, 200, 13, 77], [1, 2, 3], list(range(10, 51))]
NEW_TOKENS = 16
# 3 layers (the first dense), 8 routed experts in 2 groups (top-2 from the best group), a shared
# expert, MLA with q LoRA 48, KV LoRA 32, rope 16, nope 32, v 24 (latent 48)
DS = dict(num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
          num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
          kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24,
          routed_scaling_factor=2.5)
YARN = {"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64}
CASES = {
    "q-lora": {},
    "q-proj-yarn": dict(q_lora_rank=None, rope_scaling=YARN),
    "halves-rope": dict(rope_interleave=False),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers(case, tiny_model_dir, make_engine, run_engine, hf_greedy):
    path, hf = tiny_model_dir("deepseek_v3", **{**DS, **CASES[case]})
    engine = make_engine(model=str(path), kv_cache_memory=1 << 20, block_size=4)
    cfg = engine.model_config
    assert cfg.mla is not None and cfg.moe is not None and cfg.moe.dense_layers == (0,)
    counts = family_of(cfg.architecture).parameters(cfg)
    score_biases = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert counts.total == sum(p.numel() for p in hf.parameters()) + score_biases
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert run_engine(engine, {"long": (PROMPTS[2], greedy)})["long"] == refs[2]
    batch = run_engine(engine, {"a": (PROMPTS[0], greedy), "b": (PROMPTS[1], greedy)})
    assert [batch["a"], batch["b"]] == refs[:2]
    assert engine.kv.num_free_blocks == engine.num_blocks


def test_absorbed_and_plain_attention_agree(tiny_model_dir):
    """The decode path (W_UK in the query, scores over the latents) against the prefill path
    (latents expanded into per-head keys and values), one query over 41 latents, on a
    layer's trained-shape weights."""
    path, _ = tiny_model_dir("deepseek_v3", **DS)
    model = load_model(path)
    attn = model.layers[1].self_attn
    assert isinstance(attn, MLAttention)
    m, H, n = model.cfg.mla, model.cfg.num_heads, 41
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(n, m.latent_dim, generator=gen)  # [n, latent]: cached latents
    q_nope = torch.randn(1, H, m.qk_nope_head_dim, generator=gen)
    q_rope = torch.randn(1, H, m.qk_rope_head_dim, generator=gen)
    with torch.no_grad():
        absorbed = attn.absorbed(q_nope, q_rope, ctx.unsqueeze(0), None)[0]  # [H, v]
        sees_all = torch.ones(1, n, dtype=torch.bool)  # the query is the last position: it sees every key
        group = PrefillGroup(q_start=0, q_len=1, key_slots=torch.arange(n), mask=sees_all, cu_q=None, cu_k=None,
                             max_q=1, max_k=n)
        plain = attn.plain(q_nope, q_rope, ctx, group)[0]
    assert absorbed.abs().max() > 0.1
    torch.testing.assert_close(absorbed, plain, atol=1e-5, rtol=1e-5)


def test_kv_bytes_per_token_are_the_latents(tiny_model_dir, make_engine):
    path, _ = tiny_model_dir("deepseek_v3", **DS)
    engine = make_engine(model=str(path), kv_cache_memory=1 << 20, block_size=4)
    cfg, kv = engine.model_config, engine.runner.kv_caches  # [layers, 2, blocks + 1, block_size, 1, latent / 2]
    measured = kv[:, :, 0].numel() * kv.element_size() // kv.shape[3]  # one block's bytes / its tokens
    assert measured == cfg.num_layers * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 4 == 3 * 48 * 4
    assert measured == cfg.kv_bytes_per_token(4)
    # a Llama of the same size (4 heads of 16 over 2 KV heads) caches 2 x 2 x 16 per token and layer
    llama_path, _ = tiny_model_dir("llama", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    assert read_model_config(llama_path).kv_bytes_per_token(4) == 3 * 2 * 2 * 16 * 4


def _config(**change) -> dict:
    cfg = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
               num_attention_heads=4, **DS)
    cfg.update(change)
    return cfg


@pytest.mark.parametrize("change, field", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"scoring_func": "softmax", "topk_method": "greedy"}, "scoring_func"),
    ({"n_group": 3}, "n_group"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"kv_lora_rank": 31}, "kv_lora_rank"),
])
def test_unsupported_config_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        model_config(_config(**change))


def test_tensor_parallelism_is_refused_naming_the_latent_cache():
    cfg = model_config(_config())
    check_model_tp(cfg, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size: 2: .*latent KV cache has no heads"):
        check_model_tp(cfg, 2)


@pytest.mark.slow
def test_served_through_router_prefill_decode(served_tiny_model, hf_greedy):
    import transformers
    path = served_tiny_model("deepseek_v3", **DS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [PROMPTS[0] * 3, PROMPTS[2]]

    def latent_key(c):
        for node in ("prefill-0", "decode-0"):
            with urllib.request.urlopen(f"{c.node(node).addr}/debug/state", timeout=10) as resp:
                kv = json.loads(resp.read())["kv"]
            assert kv["latent_dim"] == 48 and kv["num_kv_heads"] == 1 and kv["head_dim"] == 24, kv
    assert_serves_greedy(path, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts], NEW_TOKENS, latent_key)
