"""benchmarks/gpu/bench_gpu_serving.py runs end to end in its --smoke mode (real redis, router,
prefill, decode and colocated node processes on the CPU, a tiny random Llama, shm KV) and
writes every figure the GPU run writes, with gpu/contract.py's top level. (With the GPU
stage's flags, --model of a weightless folder and --load-format dummy, in an environment
built like the GPU image, it runs in tests/test_gpu_suite.py's rehearsal.) Without CUDA
the full run says so and writes nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu" / "bench_gpu_serving.py"
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
        assert len(t["per_round"]) == 1 and t["failed"] == {"disaggregated": 0, "colocated": 0}
    m = f["mixed"]
    assert all(v > 0 for v in m["short_tpot_p99_ms"].values()) and m["disagg_over_colocated"] > 0
    assert all(v > 0 for v in m["long_ttft_p50_ms"].values())
    targets = {r["name"]: r for r in result["targets"]}
    assert set(targets) == {"ttft_p50_disagg_over_colocated_256", "ttft_p50_disagg_over_colocated_512",
                            "short_tpot_p99_disagg_over_colocated"}
    assert targets["ttft_p50_disagg_over_colocated_512"]["value"] == f["ttft"]["512"]["disagg_over_colocated"]
    assert targets["short_tpot_p99_disagg_over_colocated"]["value"] == m["disagg_over_colocated"]
    for r in targets.values():
        assert r["op"] == "<=" and r["met"] == (r["value"] <= r["target"])
    assert targets["ttft_p50_disagg_over_colocated_256"]["target"] == 1.10
    assert targets["short_tpot_p99_disagg_over_colocated"]["target"] == 0.5
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


def test_a_run_cut_short_leaves_the_contract(tmp_path):
    """The JSON written before any setup finished (the script writes it at its start):
    environment, plan and every target, not measured."""
    from splitserve.benchmarks.gpu.bench_gpu_serving import parse, resolve
    from splitserve.benchmarks.gpu.contract import environment
    from splitserve.benchmarks.gpu.gpu_serving_report import report

    plan = resolve(parse(["--model", "/m", "--load-format", "dummy", "--rounds", "1", "--ttft-requests", "8"]))
    assert plan.node_args == ("--load-format", "dummy") and plan.model == "/m" and plan.ttft_lens == (2048, 8000)
    out = tmp_path / "x.json"
    assert report(out, plan, [], [], 1.0, environment("cpu"), smoke=False) is False
    result = json.loads(out.read_text())
    assert result["environment"]["device"] == "cpu" and result["plan"]["rounds"] == 1
    assert result["targets"] == [
        {"name": "ttft_p50_disagg_over_colocated_2048", "value": None, "target": 1.10, "op": "<=", "met": None},
        {"name": "ttft_p50_disagg_over_colocated_8000", "value": None, "target": 1.10, "op": "<=", "met": None},
        {"name": "short_tpot_p99_disagg_over_colocated", "value": None, "target": 0.5, "op": "<=", "met": None}]


def test_smoke_refuses_the_results_path():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(RESULT)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "never writes" in proc.stderr
