"""benchmarks/kvtransfer/bench_latent_transfer.py: its formula and model configs (DeepSeek-V3's
latent of 576 values per layer, Llama-3-70B's 2048 per layer) agree with the engine's own KV
bytes per token, and its --quick mode (512 tokens, real clusters) measures exactly the formula."""

import json
import os
import subprocess
import sys

import pytest

from splitserve.benchmarks.kvtransfer import bench_latent_transfer as bench
from splitserve.engine.models.families import model_config

VOCAB = dict(vocab_size=1000, bos_token_id=0, eos_token_id=1)


def test_configs_have_the_real_models_cache_per_layer():
    ds, llama = bench.deepseek_config(vocab=VOCAB), bench.llama_config(vocab=VOCAB)
    assert ds["num_hidden_layers"] == llama["num_hidden_layers"] and ds["hidden_size"] == llama["hidden_size"]
    assert bench.kv_values_per_layer(ds) == 512 + 64
    assert bench.kv_values_per_layer(llama) == 8 * 128 * 2
    assert llama["num_attention_heads"] > llama["num_key_value_heads"]  # grouped queries
    assert ds["max_position_embeddings"] >= 8192 + 1 and llama["max_position_embeddings"] >= 8192 + 1


@pytest.mark.parametrize("itemsize", [4, 2])
def test_formula_equals_the_engines_kv_bytes_per_token(itemsize):
    for cfg in (bench.deepseek_config(vocab=VOCAB), bench.llama_config(vocab=VOCAB)):
        formula = bench.formula_bytes_per_token(cfg, itemsize)
        assert formula == cfg["num_hidden_layers"] * bench.kv_values_per_layer(cfg) * itemsize
        assert model_config(cfg).kv_bytes_per_token(itemsize) == formula
    assert bench.formula_bytes_per_token(bench.deepseek_config(vocab=VOCAB), 4) == 4 * 576 * 4


def test_transformers_builds_both_configs():
    import transformers

    kwargs = lambda cfg: {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}  # noqa: E731
    ds = transformers.DeepseekV3Config(**kwargs(bench.deepseek_config(vocab=VOCAB)))
    llama = transformers.LlamaConfig(**kwargs(bench.llama_config(vocab=VOCAB)))
    assert (ds.kv_lora_rank, ds.qk_rope_head_dim) == (512, 64)
    assert (llama.num_key_value_heads, llama.head_dim) == (8, 128)


@pytest.mark.slow
def test_quick_run_measures_the_formula(tmp_path):
    out = tmp_path / "latent_transfer.json"
    proc = subprocess.run([sys.executable, "-m", "splitserve.benchmarks.kvtransfer.bench_latent_transfer", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["tokens"] == 512 and set(res["models"]) == {"latent", "gqa"}
    for m in res["models"].values():
        assert m["measured_bytes_per_token"] == m["formula_bytes_per_token"] == m["pool_bytes_per_token"]
        assert m["prompt_bytes_sent"] == m["prompt_bytes_formula"]
        assert all(r["cached_tokens"] in (0, None) for r in m["reps"])
    assert res["ratio_gqa_over_latent"]["measured_bytes_per_token"] == 2048 / 576
