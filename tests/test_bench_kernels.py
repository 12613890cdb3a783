"""benchmarks/gpu/bench_kernels.py keeps working without a GPU: --smoke runs the same code on
the CPU at tiny sizes (torch and SDPA timed by perf_counter, the Triton kernel by its
interpreter), and writes the gpu/contract.py top level and a row per case."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu" / "bench_kernels.py"


@pytest.mark.slow
def test_smoke_run_writes_rows_and_targets(tmp_path):
    pytest.importorskip("triton", reason="the smoke run's kernel is the interpreted Triton one")
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "smoke" and result["environment"]["device"] == "cpu"
    assert "bench_kernels.py --smoke" in result["environment"]["command"]
    assert result["auto_backend"] == "triton" and "cuda" in result["backend_errors"]  # no GPU: recorded, not fatal
    assert [(r["context"], r["batch"]) for r in result["rows"]] == [(64, 1), (64, 2), (256, 1), (256, 2)]
    for r in result["rows"]:
        assert r["triton_us"] > 0 and r["torch_us"] > 0 and r["sdpa_us"] > 0 and "triton_error" not in r
        assert r["triton_speedup_vs_sdpa"] == round(r["sdpa_us"] / r["triton_us"], 4)
    targets = {t["name"]: t for t in result["targets"]}
    assert set(targets) == {"paged_attention_pct_of_copy_ctx256_b2", "paged_attention_speedup_vs_sdpa_ctx64"}
    assert targets["paged_attention_pct_of_copy_ctx256_b2"]["value"] == result["rows"][-1]["triton_pct_copy"]
    assert targets["paged_attention_speedup_vs_sdpa_ctx64"]["value"] == min(
        r["triton_speedup_vs_sdpa"] for r in result["rows"][:2])
    assert all(t["met"] is (t["value"] >= t["target"]) for t in targets.values())
    assert out.with_suffix(".png").stat().st_size > 0


def test_targets_follow_the_auto_backend_and_stay_null_until_measured():
    from splitserve.benchmarks.gpu.bench_kernels import Plan, targets

    plan = Plan(quick=True, smoke=False)
    rows = [{"context": 512, "batch": 1, "cuda_speedup_vs_sdpa": 1.3, "triton_speedup_vs_sdpa": 0.7}]
    got = {t["name"]: t for t in targets(rows, "cuda", plan)}
    assert got["paged_attention_speedup_vs_sdpa_ctx512"]["value"] is None  # batch 64 at 512 not measured yet
    assert got["paged_attention_pct_of_copy_ctx32768_b64"]["met"] is None
    rows += [{"context": 512, "batch": 64, "cuda_speedup_vs_sdpa": 1.1, "triton_speedup_vs_sdpa": 2.0},
             {"context": 32768, "batch": 64, "cuda_pct_copy": 85.0, "triton_pct_copy": 60.0}]
    got = {t["name"]: t for t in targets(rows, "cuda", plan)}
    assert got["paged_attention_speedup_vs_sdpa_ctx512"]["value"] == 1.1  # the lowest over batches
    assert got["paged_attention_pct_of_copy_ctx32768_b64"] == {
        "name": "paged_attention_pct_of_copy_ctx32768_b64", "value": 85.0, "target": 80.0, "op": ">=", "met": True}
    got = {t["name"]: t for t in targets(rows, "triton", plan)}  # the CUDA kernels did not build
    assert got["paged_attention_speedup_vs_sdpa_ctx512"]["met"] is False
    assert got["paged_attention_pct_of_copy_ctx32768_b64"]["met"] is False
    assert all(t["value"] is None for t in targets(rows, None, plan))  # no kernel at all
