"""benchmarks/serving/bench_pull_holder.py's and bench_pull_memory.py's arithmetic (the holder's
step growth over the budget, pooled over rounds; when a run is not sustained), and both
scripts' smoke runs on real nodes (``--quick``)."""

import json

import pytest

from splitserve.benchmarks.serving.bench_pull_holder import SPREAD_LIMIT, summarize, sustained
from splitserve.node.pull_budget import PULL_STEP_SHARE


def _window(gaps, copy_s=0.0, pulls=0, failed=()):
    return {"gaps": gaps, "copy_s": copy_s, "window_s": 10.0, "pulls": pulls, "blocks": 256 * pulls,
            "failed": list(failed), "forward_s": 0.09 * len(gaps), "forwards": len(gaps)}


def test_growth_is_over_the_batch_alone_and_its_share_of_the_budget():
    s = summarize({"none": [_window([0.1] * 50), _window([0.1] * 50)],
                   "1": [_window([0.105] * 50, copy_s=0.4, pulls=4)],
                   "8": [_window([0.11] * 40, copy_s=0.9, pulls=8)]})
    assert s["none"]["growth"] == 0.0
    assert s["1"]["growth"] == pytest.approx(0.05) and s["1"]["growth_over_budget"] == pytest.approx(0.05 / PULL_STEP_SHARE)
    assert s["8"]["growth_over_budget"] == pytest.approx(1.0)
    assert s["8"]["copy_share"] == pytest.approx(0.09) and s["8"]["pulls_per_s"] == pytest.approx(0.8)
    assert s["8"]["forward_ms"] == pytest.approx(90.0)
    assert sustained(s) == (True, [])


def test_a_moving_baseline_or_a_failed_pull_is_not_sustained():
    moved = summarize({"none": [_window([0.1] * 10), _window([0.1 * SPREAD_LIMIT * 1.01] * 10)]})
    ok, why = sustained(moved)
    assert not ok and "moved" in why[0]
    failed = summarize({"none": [_window([0.1] * 10)], "1": [_window([0.1] * 10, failed=["holder answered 503"])]})
    ok, why = sustained(failed)
    assert not ok and "503" in why[0]


@pytest.mark.slow
def test_both_scripts_run_small_and_write_their_results(tmp_path):
    from splitserve.benchmarks.serving import bench_pull_holder, bench_pull_memory

    assert bench_pull_holder.main(["--quick", "--out", str(tmp_path / "holder.json")]) in (0, 1)
    holder = json.loads((tmp_path / "holder.json").read_text())
    assert set(holder["arms"]) == {"none", "1", "2"} and holder["arms"]["2"]["pulls_per_s"] > 0
    assert bench_pull_memory.main(["--quick", "--out", str(tmp_path / "memory.json")]) == 0
    memory = json.loads((tmp_path / "memory.json").read_text())
    capped, uncapped = memory["holders"]["capped"], memory["holders"]["uncapped"]
    assert memory["cap_held"] and 0 < capped["packed_peak"] <= capped["cap"] == 1 << 20
    assert uncapped["packed_peak"] > capped["cap"]
