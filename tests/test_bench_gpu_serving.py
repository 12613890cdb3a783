"""benchmarks/bench_gpu_serving.py runs end to end in its --smoke mode (real redis, router,
prefill, decode and colocated node processes on the CPU, a tiny random Llama, shm KV) and
writes every figure the GPU run writes; without CUDA the full run says so and writes nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "bench_gpu_serving.py"
RESULT = Path(__file__).parent.parent / "benchmarks" / "results" / "gpu_serving.json"


@pytest.mark.slow
def test_smoke_run_writes_every_figure(tmp_path):
    out = tmp_path / "gpu_serving_smoke.json"
    before = RESULT.stat().st_mtime_ns if RESULT.exists() else None
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "round 1/1: disaggregated then colocated" in proc.stdout  # progress lines
    result = json.loads(out.read_text())
    assert result["mode"] == "smoke" and result["environment"]["device"] == "cpu" and not result["errors"]
    assert "bench_gpu_serving.py --smoke" in result["environment"]["command"]
    f = result["figures"]
    assert set(f["ttft"]) == {"256", "512"}
    for t in f["ttft"].values():
        assert all(v > 0 for v in t["p50_ms"].values()) and t["disagg_over_colocated"] > 0
        assert t["target_max"] == 1.10 and isinstance(t["met"], bool) and len(t["per_round"]) == 1
        assert t["failed"] == {"disaggregated": 0, "colocated": 0}
    m = f["mixed"]
    assert all(v > 0 for v in m["short_tpot_p99_ms"].values()) and m["disagg_over_colocated"] > 0
    assert m["target_max"] == 0.5 and all(v > 0 for v in m["long_ttft_p50_ms"].values())
    kv = f["kv_transfer"]
    # every block of every ttft prompt crossed (tiny model: 2 layers x K,V x 16 tokens x 2 KV heads
    # x head dim 16 x fp32)
    block = 2 * 2 * 16 * 2 * 16 * 4
    assert kv["by_prompt_len"]["256"]["bytes"] == 3 * 16 * block
    assert kv["by_prompt_len"]["512"]["bytes"] == 3 * 32 * block
    assert kv["gb_s"] > 0 and kv["copy_gb_s"] > 0 and kv["over_copy"] > 0
    check = f["disaggregation_check"]
    assert check["fallback_prefills"] == 0 and check["transfers_failed"] == 0
    assert check["transfers_owned"] == 3 + 3 + 8 + 3  # every request of the disaggregated setup
    assert out.with_suffix(".png").stat().st_size > 0
    assert (RESULT.stat().st_mtime_ns if RESULT.exists() else None) == before  # smoke never lands there


def test_without_cuda_nothing_runs_and_nothing_is_written(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "x.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout and not out.exists()


def test_smoke_refuses_the_results_path():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(RESULT)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "never writes" in proc.stderr
