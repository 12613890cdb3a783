"""benchmarks/gpu/bench_gpu_transfer.py keeps working without a GPU: its --smoke mode runs the
same code on the CPU (tcp between two processes) and writes the JSON a GPU run writes."""

import json
import os
import subprocess
import sys



def test_smoke_run_writes_its_figures(tmp_path):
    out = tmp_path / "gpu_transfer.json"
    proc = subprocess.run([sys.executable, "-m", "splitserve.benchmarks.gpu.bench_gpu_transfer", "--smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    env = result["environment"]
    assert env["device"] == "cpu" and result["smoke"] and "--smoke" in env["command"]
    assert result["targets"] == []  # no numeric target: the rates and their ratios to the copy
    assert result["copy_gbps"] > 0 and result["pack_gbps"] > 0 and result["wsum_gbps"] > 0
    assert result["pack_over_copy"] == result["pack_gbps"] / result["copy_gbps"]
    assert set(result["backends"]) == {"tcp"} and set(result["backends"]["tcp"]) == {"1", "8"}
    for n, gbps in result["backends"]["tcp"].items():
        assert gbps > 0 and result["transfer_over_copy"]["tcp"][n] == gbps / result["copy_gbps"]
    assert result["block_nbytes"] == 30 * 2 * 16 * 3 * 64 * 4
