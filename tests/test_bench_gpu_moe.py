"""benchmarks/gpu/bench_gpu_moe.py without a GPU: its floor arithmetic (experts hit under
uniform routing, the bytes read, the memory a shape needs), its targets when a shape is
skipped or cut short, and its --smoke run (each MoE shape shrunk, on the CPU), which counts
the experts read from the real routing."""

import json
import os
import subprocess
import sys

import pytest

from splitserve.benchmarks.gpu import bench_gpu_moe as moe
from splitserve.common.roofline import expected_experts
from splitserve.engine.models.families import family_of, model_config


def test_expected_experts():
    assert expected_experts(8, 2, 1) == pytest.approx(2)  # one token: its k experts
    assert expected_experts(128, 8, 1) == pytest.approx(8)
    assert expected_experts(8, 2, 64) == pytest.approx(8, abs=1e-6)  # a big batch hits every expert
    assert 8 < expected_experts(128, 8, 64) < 128
    assert expected_experts(8, 8, 3) == pytest.approx(8)  # k = E: all of them


def test_floor_counts_dense_and_read_experts():
    assert moe.floor_seconds(1000, [10, 20], [2, 3], 100.0) == pytest.approx((1000 + 20 + 60) / 100)
    with pytest.raises(AssertionError):
        moe.floor_seconds(1000, [10], [2, 3], 100.0)


@pytest.mark.parametrize("name, fits_80gb", [("qwen3-30b-a3b", True), ("mixtral-8x7b", False)])
def test_memory_needed_of_the_shipped_shapes(name, fits_80gb):
    """Mixtral-8x7B in bf16 does not fit an 80 GB H100 (so the stage skips it there); Qwen3-30B-A3B does."""
    cfg = model_config(moe.shape_config(name, smoke=False))
    need = moe.memory_needed(family_of(cfg.architecture).parameters(cfg).total, 2, 4 << 30)
    assert (need <= 79 * 2**30) is fits_80gb and need < 139 * 2**30  # fits an H200


def test_targets_of_a_skipped_or_cut_short_run_are_null():
    result = {"shapes_asked": list(moe.SHAPES), "batches": [1, 64],
              "shapes": {"qwen3-30b-a3b": {"b1": {"step_over_floor": 1.3}}, "mixtral-8x7b": {"skipped": "memory"}}}
    rows = {r["name"]: r for r in moe.targets(result)}
    assert set(rows) == {f"moe_decode_step_over_floor_{s}_b{n}" for s in moe.SHAPES for n in (1, 64)}
    assert rows["moe_decode_step_over_floor_qwen3-30b-a3b_b1"]["met"] is True
    assert rows["moe_decode_step_over_floor_qwen3-30b-a3b_b64"]["value"] is None
    assert rows["moe_decode_step_over_floor_mixtral-8x7b_b1"]["met"] is None


def test_smoke_run_counts_the_experts_routing_read(tmp_path):
    out = tmp_path / "moe.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", SPLITSERVE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "splitserve.benchmarks.gpu.bench_gpu_moe", "--smoke", "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "smoke" and result["environment"]["device_name"] == "cpu"
    for name in moe.SHAPES:
        shape = result["shapes"][name]
        assert shape["moe_layers"] == 2 and shape["dense_bytes"] > 0 and shape["expert_bytes"] > 0
        for n in result["batches"]:
            b = shape[f"b{n}"]
            assert b["counted"] == "routing" and 1 <= b["experts_read_per_layer"] <= shape["experts"]
            assert b["step_ms"] > 0 and b["floor_ms"] > 0 and b["step_over_floor"] > 0
        assert shape["b1"]["experts_read_per_layer"] == shape["top_k"]  # one token reads exactly its k experts
    assert len(result["targets"]) == 4 and all(t["value"] is not None for t in result["targets"])
