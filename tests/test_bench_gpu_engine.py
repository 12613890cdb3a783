"""benchmarks/gpu/bench_gpu_engine.py runs end to end in its --smoke mode (tiny random model
on the CPU, both sides on the same weights, and the random-weight big shape), with no
converted bundled model at hand, and writes every figure and the gpu/contract.py top level."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu" / "bench_gpu_engine.py"


def run(tmp_path, *args) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "gpu_engine_smoke.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", SPLITSERVE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", *args, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, out


def check_targets(rows: list[dict], names: set[str]) -> None:
    assert {r["name"] for r in rows} == names
    for r in rows:
        assert r["op"] in ("<=", ">=") and r["target"] > 0 and r["value"] > 0
        assert r["met"] == (r["value"] <= r["target"] if r["op"] == "<=" else r["value"] >= r["target"])


@pytest.mark.slow
def test_smoke_run_writes_all_figures(tmp_path):
    proc, out = run(tmp_path)
    result = json.loads(out.read_text())
    env = result["environment"]
    assert result["mode"] == "smoke" and result["part"] == "all" and env["device_name"] == "cpu"
    assert "bench_gpu_engine.py --smoke" in env["command"] and env["torch"] and "driver" in env
    bundled = result["bundled"]
    assert set(bundled["decode_step_b1_ms"]) == {"static", "static_sync", "eager", "transformers"}
    assert all(v > 0 for v in bundled["decode_step_b1_ms"].values())
    assert set(bundled["decode_tok_s"]) == {"b4", "b8"}
    assert all(r["splitserve"] > 0 and r["transformers"] > 0 for r in bundled["decode_tok_s"].values())
    assert set(bundled["prefill_tok_s"]) == {"1x64", "4x16"}
    big = result["llama3_8b_shape"]
    assert big["weight_bytes"] > 0 and big["weight_read_floor_ms"] > 0 and big["copy_bandwidth_gb_s"] > 0
    assert big["decode_step_over_floor"] > 0 and set(big["decode_tok_s"]) == {"b4", "b8"}
    check_targets(result["targets"], {"bundled_decode_step_b1_ms", "bundled_decode_tok_s_b8",
                                      "bundled_prefill_tok_s_64", "llama3_8b_decode_step_over_floor"})
    by_name = {r["name"]: r for r in result["targets"]}
    assert by_name["bundled_decode_step_b1_ms"]["value"] == bundled["decode_step_b1_ms"]["static"]
    assert by_name["bundled_prefill_tok_s_64"]["value"] == min(r["splitserve"]
                                                               for r in bundled["prefill_tok_s"].values())
    assert "target bundled_decode_step_b1_ms" in proc.stdout


@pytest.mark.slow
def test_parts_and_model_dir(tmp_path):
    """--part big runs only the big shape; --part bundled --model-dir takes the shape's
    vocabulary from DIR/config.json (a folder with no weights, as the suite carries)."""
    _, out = run(tmp_path, "--part", "big")
    result = json.loads(out.read_text())
    assert "bundled" not in result and result["llama3_8b_shape"]["decode_step_over_floor"] > 0
    check_targets(result["targets"], {"llama3_8b_decode_step_over_floor"})

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2}))
    _, out = run(tmp_path, "--part", "bundled", "--model-dir", str(model))
    result = json.loads(out.read_text())
    assert "llama3_8b_shape" not in result
    assert result["bundled"]["config"] == {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 300}
    check_targets(result["targets"], {"bundled_decode_step_b1_ms", "bundled_decode_tok_s_b8",
                                      "bundled_prefill_tok_s_64"})


def test_targets_of_a_run_cut_short_are_null():
    from splitserve.benchmarks.gpu.bench_gpu_engine import Plan, targets

    plan = Plan(smoke=False, steps=None)
    rows = targets({"part": "all", "bundled": {"decode_step_b1_ms": {"static": 2.0},
                                               "prefill_tok_s": {"1x2048": {"splitserve": 9e4}}}}, plan)
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == {"bundled_decode_step_b1_ms", "bundled_decode_tok_s_b256", "bundled_prefill_tok_s_2048",
                            "llama3_8b_decode_step_over_floor"}
    assert by_name["bundled_decode_step_b1_ms"]["met"] is True
    assert by_name["bundled_prefill_tok_s_2048"] == {"name": "bundled_prefill_tok_s_2048", "value": None,
                                                     "target": 50000, "op": ">=", "met": None}  # 2 of 3 missing
    assert by_name["bundled_decode_tok_s_b256"]["met"] is None
    assert by_name["llama3_8b_decode_step_over_floor"]["value"] is None
