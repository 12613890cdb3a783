"""The shipped MoE shapes (benchmarks/model_configs/qwen3-30b-a3b, mixtral-8x7b) read through the
family registry into MoE configs with their checkpoints' expert counts; their families' parameter
counts are within 2% of the published totals and match transformers' on the meta device (no
memory); and a shrunk copy of each loads with ``load_format="dummy"`` into the MoE module.
Full-size weights are never built here."""

import json
from pathlib import Path

import pytest
import torch

from splitserve.engine.models.loader import load_model
from splitserve.engine.models.moe import MoEBlock
from splitserve.engine.models.families import family_of, read_model_config

CONFIGS = Path(__file__).parents[1] / "benchmarks" / "model_configs"
# folder -> (architecture, experts, top_k, expert width, published total and active parameters, KV bytes/token bf16)
SHAPES = {
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", 128, 8, 768, 30.5e9, 3.3e9, 98_304),
    "mixtral-8x7b": ("MixtralForCausalLM", 8, 2, 14336, 46.7e9, 12.9e9, 131_072),
}
SHRUNK = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=96, moe_intermediate_size=32, vocab_size=300, max_position_embeddings=256)


@pytest.mark.parametrize("name", SHAPES)
def test_config_reads_as_moe_with_published_counts(name):
    arch, experts, top_k, width, total, active, kv_bytes = SHAPES[name]
    cfg = read_model_config(CONFIGS / name)
    assert cfg.architecture == arch and cfg.moe is not None
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (experts, top_k, width)
    assert cfg.moe.dense_layers == () and cfg.moe.shared_expert_size == 0 and cfg.moe.norm_topk_prob
    assert cfg.kv_bytes_per_token(torch.bfloat16.itemsize) == kv_bytes
    counts = family_of(cfg.architecture).parameters(cfg)
    assert abs(counts.total / total - 1) < 0.02, counts
    assert abs(counts.active / active - 1) < 0.02, counts


@pytest.mark.parametrize("name", SHAPES)
def test_counts_match_transformers_on_the_meta_device(name):
    """The family's count is what both modules hold, built on "meta" (shapes only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = read_model_config(CONFIGS / name)
    family = family_of(cfg.architecture)
    with torch.device("meta"):
        ours = family.module(cfg, None)
        theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIGS / name))
    total = family.parameters(cfg).total
    assert sum(p.numel() for p in ours.parameters()) == total
    assert sum(p.numel() for p in theirs.parameters()) == total


@pytest.mark.parametrize("name", SHAPES)
def test_a_shrunk_copy_loads_with_dummy_weights(tmp_path, name):
    """The config with fewer layers, experts and smaller widths (its routing fields kept) builds
    the MoE module with random weights of the family's count, and routes tokens."""
    _, experts, top_k, *_ = SHAPES[name]
    config = json.loads((CONFIGS / name / "config.json").read_text()) | SHRUNK
    for key in ("num_experts", "num_local_experts"):
        if key in config:
            config[key] = min(experts, 8)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path, torch.float32, "cpu", load_format="dummy")
    cfg = model.cfg
    assert cfg.moe is not None
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    assert len(blocks) == 2 and blocks[0].w13.shape == (min(experts, 8), 2 * cfg.moe.intermediate_size, 64)
    assert sum(p.numel() for p in model.parameters()) == family_of(cfg.architecture).parameters(cfg).total
    x = torch.randn(5, 64)
    assert blocks[0](x).shape == (5, 64) and int(blocks[0].expert_tokens.sum()) == 5 * top_k
