"""Every supported family (Llama with each RoPE scaling, Qwen2, Qwen3, Mistral) loads
from a transformers safetensors folder and decodes greedily token for token like
transformers ``generate``; ``load_format="dummy"`` builds real shapes from a
config.json alone; bad configs raise ValueError naming the field."""

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from splitserve.common.config import EngineConfig
from splitserve.common.errors import InvalidRequest
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.llm import LLM
from splitserve.engine.models.loader import load_model
from splitserve.engine.models.llama import CausalLM
from splitserve.engine.models.config import ModelConfig
from splitserve.engine.models.families import family_of, model_config, read_model_config
from splitserve.engine.model_runner import kv_block_bytes

CONFIGS = Path(__file__).parents[1] / "benchmarks" / "model_configs"
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# Prompts of 9, 3 and 41 tokens: with block_size 4 the last spans 11 KV blocks.
PROMPTS = [[5, 17, 42, 99, 3, 8, 200, 13, 77], [1, 2, 3], list(range(10, 51))]
NEW_TOKENS = 20


def num_parameters(cfg: ModelConfig) -> int:
    """Parameters of the model (a tied head counted once): its family's count from the config's shapes alone."""
    return family_of(cfg.architecture).parameters(cfg).total


FAMILIES = {  # case -> (family, transformers config overrides, ModelConfig fields expected)
    "llama": ("llama", {}, {"qkv_bias": False, "qk_norm": False}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, {}),
    "llama3-rope-tied-bias": ("llama", {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True,
                                        "attention_bias": True, "mlp_bias": True},
                              {"qkv_bias": True, "o_bias": True, "mlp_bias": True}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True},
                   {"qkv_bias": True, "o_bias": False, "tie_word_embeddings": True}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
                     {"sliding_window": 64, "max_position_embeddings": 64}),
    "qwen3": ("qwen3", {"head_dim": 32}, {"qk_norm": True, "head_dim": 32, "qkv_bias": False}),
    "qwen3-bias-linear-rope": ("qwen3", {"head_dim": 8, "attention_bias": True,
                                        "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
                               {"qk_norm": True, "head_dim": 8, "o_bias": True}),
    "mistral": ("mistral", {"sliding_window": None}, {"sliding_window": None, "max_position_embeddings": 256}),
    "mistral-window": ("mistral", {"sliding_window": 64}, {"sliding_window": 64, "max_position_embeddings": 64}),
}


@pytest.mark.parametrize("case", FAMILIES)
def test_family_matches_transformers(case, tiny_model_dir, make_engine, run_engine, hf_greedy):
    """Greedy tokens equal transformers' (both stop after EOS): a prompt over 11 KV
    blocks alone, then a batch of two."""
    family, overrides, expected = FAMILIES[case]
    path, hf = tiny_model_dir(family, **overrides)
    engine = make_engine(model=str(path), kv_cache_memory=1 << 20, block_size=4)
    cfg = engine.model_config
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert sum(p.numel() for p in hf.parameters()) == num_parameters(cfg)
    assert engine.max_model_len == cfg.max_position_embeddings
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert len(refs[2]) > 5, "the long prompt should decode for a while before any EOS"
    alone = run_engine(engine, {"long": (PROMPTS[2], greedy)})
    assert alone["long"] == refs[2]
    batch = run_engine(engine, {"a": (PROMPTS[0], greedy), "b": (PROMPTS[1], greedy)})
    assert [batch["a"], batch["b"]] == refs[:2]
    assert engine.kv.num_free_blocks == engine.num_blocks


def test_sliding_window_caps_the_context(tiny_model_dir, make_engine, caplog):
    path, _ = tiny_model_dir("mistral", sliding_window=64)
    engine = make_engine(model=str(path), kv_cache_memory=1 << 20, block_size=4)
    assert "capped at 64 tokens" in caplog.text
    with pytest.raises(InvalidRequest) as err:
        engine.limits.check(list(range(60)), SamplingParams(max_tokens=10))
    assert err.value.field == "max_tokens" and "64" in str(err.value)


@pytest.mark.parametrize("fields, window", [
    ({"use_sliding_window": True, "max_window_layers": 28}, 64),  # pre-layer_types Qwen: layers 28+ slide
    ({"use_sliding_window": True, "max_window_layers": 36}, None),  # no layer reaches max_window_layers
    ({"use_sliding_window": False, "max_window_layers": 0}, None),  # published Qwen2.5 configs
    ({"layer_types": ["full_attention"] * 35 + ["sliding_attention"]}, 64),
])
def test_qwen_sliding_window_from_either_config_form(fields, window):
    cfg = json.loads((CONFIGS / "qwen3-8b" / "config.json").read_text())
    for key in ("use_sliding_window", "max_window_layers"):
        cfg.pop(key)
    parsed = model_config({**cfg, "sliding_window": 64, **fields})
    assert parsed.sliding_window == window
    assert parsed.max_position_embeddings == (64 if window else 40960)


@pytest.mark.parametrize("name, params, kv_bytes, arch", [
    ("llama3-8b", 8_030_261_248, 131_072, "LlamaForCausalLM"),
    ("qwen3-8b", 8_190_735_360, 147_456, "Qwen3ForCausalLM"),
])
def test_shipped_shapes_on_the_meta_device(name, params, kv_bytes, arch):
    """The published parameter counts and bf16 KV bytes per token, without allocating weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = read_model_config(CONFIGS / name)
    assert cfg.architecture == arch
    assert num_parameters(cfg) == params
    assert cfg.kv_bytes_per_token(torch.bfloat16.itemsize) == kv_bytes
    assert kv_block_bytes(cfg, 16, torch.bfloat16) == 16 * kv_bytes  # what the KV pool is sized by
    with torch.device("meta"):
        ours = CausalLM(cfg)
        theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIGS / name))
    assert sum(p.numel() for p in ours.parameters()) == params
    assert sum(p.numel() for p in theirs.parameters()) == params  # the config.json reads the same in transformers


def _config_only_dir(tmp_path, model_type="qwen3", **overrides) -> Path:
    """A folder holding only a tiny config.json (no weights, no tokenizer); the
    architecture comes from model_type, as the family registry reads configs without one."""
    from transformers import AutoConfig

    cfg = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, eos_token_id=299)
    cfg.update(overrides)
    AutoConfig.for_model(model_type, **cfg).save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    return tmp_path


def test_dummy_load_generates_from_token_ids_without_tokenizer(tmp_path):
    path = _config_only_dir(tmp_path, head_dim=32)
    with pytest.raises(ValueError, match="load_format dummy"):
        LLM(model=str(path), kv_cache_memory=1 << 20)  # auto: no weights here
    llm = LLM(model=str(path), load_format="dummy", kv_cache_memory=1 << 20, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([[1, 2, 3, 4, 5, 6, 7], [9, 8]], params)
    assert [len(o.token_ids) for o in out] == [12, 12] and [o.text for o in out] == ["", ""]
    again = LLM(model=str(path), load_format="dummy", kv_cache_memory=1 << 20, block_size=4)
    assert [o.token_ids for o in again.generate([[1, 2, 3, 4, 5, 6, 7], [9, 8]], params)] == \
        [o.token_ids for o in out]  # seeded: the same weights on every load
    weights = dict(again.engine.runner.model.named_parameters())
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert len(set(out[0].token_ids)) > 1, "random weights should not collapse to one token"
    for prompt, params, field in [("text", SamplingParams(), "prompt"),
                                  ([{"role": "user", "content": "hi"}], SamplingParams(), "prompt"),
                                  ([1, 2], SamplingParams(stop=["x"]), "stop")]:
        with pytest.raises(InvalidRequest, match="tokenizer") as err:
            llm.generate([prompt], params)
        assert err.value.field == field
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dummy_activations_stay_finite(tmp_path, dtype):
    """Dummy weights at a deeper, wider shape keep every logprob finite and the logits spread."""
    path = _config_only_dir(tmp_path, "llama", hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=2, vocab_size=1000, eos_token_id=999)
    llm = LLM(model=str(path), load_format="dummy", dtype=dtype, kv_cache_memory=4 << 20)
    out = llm.generate(list(range(1, 65)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                          logprobs=5))[0]
    for lp in out.logprobs:
        values = [v for _, v in lp.top]
        assert all(map(math.isfinite, values)) and values[0] > values[-1]


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_config_names_the_field(change, field):
    cfg = json.loads((CONFIGS / "llama3-8b" / "config.json").read_text())
    cfg.update(change)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        model_config(cfg)


def test_load_format_flag_and_validation():
    from splitserve.cli import _add_engine_args, engine_config

    p = argparse.ArgumentParser()
    _add_engine_args(p)
    assert engine_config(p.parse_args([])).load_format == "auto"
    cfg = engine_config(p.parse_args(["--model", str(CONFIGS / "llama3-8b"), "--load-format", "dummy"]))
    assert cfg.load_format == "dummy" and cfg.model.endswith("llama3-8b")
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="pt")


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MistralForCausalLM"]}, "unexpected weights .*qkv_proj.bias"),  # Qwen2 biases, no slot
    ({"intermediate_size": 96}, "gate_up_proj.weight .* has shape"),
])
def test_checkpoint_that_disagrees_with_its_config_is_refused(tiny_model_dir, change, message):
    path, _ = tiny_model_dir("qwen2")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=message):
        load_model(path)
