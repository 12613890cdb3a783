"""benchmarks/bench_gpu_engine.py runs end to end in its --smoke mode (tiny random model
on the CPU, both sides and the random-weight big shape) and writes every figure."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "bench_gpu_engine.py"


@pytest.mark.slow
def test_smoke_run_writes_all_figures(tmp_path):
    out = tmp_path / "gpu_engine_smoke.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "smoke" and result["environment"]["device_name"] == "cpu"
    assert "bench_gpu_engine.py --smoke" in result["environment"]["command"]
    bundled = result["bundled"]
    assert set(bundled["decode_step_b1_ms"]) == {"static", "static_sync", "eager", "transformers"}
    assert all(v > 0 for k, v in bundled["decode_step_b1_ms"].items() if k != "transformers")
    assert set(bundled["decode_tok_s"]) == {"b4", "b8"}
    assert all(r["splitserve"] > 0 for r in bundled["decode_tok_s"].values())
    assert set(bundled["prefill_tok_s"]) == {"1x64", "4x16"}
    big = result["llama3_8b_shape"]
    assert big["weight_bytes"] > 0 and big["weight_read_floor_ms"] > 0 and big["copy_bandwidth_gb_s"] > 0
    assert big["decode_step_over_floor"] > 0 and set(big["decode_tok_s"]) == {"b4", "b8"}


def test_cuda_without_a_gpu_writes_nothing(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "x.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout and not out.exists()
