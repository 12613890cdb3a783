"""The soak's drift figure (benchmarks/reliability/soak_control.py) on synthetic latencies: a shared
machine load that moves every latency by 3x cancels out of the aged/fresh ratio, a
real slowdown of the aged cluster shows in full, and only pairs where both requests
succeeded after the warm-up count."""

import math
import random

import pytest
from splitserve.benchmarks.harness import Outcome, RequestResult
from splitserve.benchmarks.reliability.soak_control import control_drift, ok_pairs, percentile


def loaded_pairs(n: int, aged_factor: float, seed: int = 1) -> list[tuple[float, float]]:
    """Pairs sent one slot apart on a machine whose load swings 1x..3x over the window:
    both requests of a pair see the same load, each has its own 2% jitter."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        load = 2.0 + math.sin(i / n * 2 * math.pi)  # 1x .. 3x
        base = rng.lognormvariate(0.7, 0.3)  # the request's own cost, shared by the pair (same prompt)
        out.append((aged_factor * base * load * rng.uniform(0.98, 1.02), base * load * rng.uniform(0.98, 1.02)))
    return out


def test_percentile_is_by_rank():
    assert percentile(list(range(1, 301)), 0.99) == 298
    assert percentile([5.0], 0.99) == 5.0
    assert math.isnan(percentile([], 0.5))


def test_shared_load_cancels_out_of_the_ratio():
    pairs = loaded_pairs(300, aged_factor=1.0)
    d = control_drift(pairs)
    assert abs(d.p99_drift) < 0.05 and abs(d.p50_ratio - 1) < 0.05
    lo, hi = d.p99_drift_ci90
    assert lo <= 0.0 <= hi
    # the old figure, the aged cluster's own p99 late against early, follows the load instead
    aged = [a for a, _ in pairs]
    first, last = percentile(aged[:100], 0.99), percentile(aged[150:250], 0.99)
    assert last / first - 1 < -0.3


def test_a_slower_aged_cluster_shows_in_full():
    pairs = [(1.25 * f, f) for _, f in loaded_pairs(300, aged_factor=1.0)]
    d = control_drift(pairs)
    assert d.p99_ratio == pytest.approx(1.25, abs=1e-3) and d.p50_ratio == pytest.approx(1.25, abs=1e-3)
    assert d.p99_drift == pytest.approx(0.25, abs=1e-3)
    assert d.p99_drift_ci90[0] == pytest.approx(0.25, abs=1e-3)  # every resample: the same ratio
    assert d.p99_drift >= 0.10  # judged: not met
    assert control_drift(loaded_pairs(300, aged_factor=1.3)).p99_drift_ci90[0] > 0.10


def test_no_pairs_is_a_clear_error():
    with pytest.raises(ValueError, match="no request pair"):
        control_drift([])


def test_ok_pairs_skips_warmup_and_failed_pairs():
    def r(started: float, latency: float, outcome: Outcome = Outcome.OK) -> RequestResult:
        return RequestResult(outcome, started, started + latency, "", None)
    aged = [r(0.0, 9.0), r(10.0, 1.0), r(11.0, 2.0, Outcome.FAILED), r(12.0, 3.0)]
    fresh = [r(0.5, 9.0), r(10.5, 1.5), r(11.5, 2.5), r(12.5, 3.5, Outcome.FAILED)]
    assert ok_pairs(aged, fresh, after=5.0) == [(1.0, 1.5)]
    with pytest.raises(ValueError):
        ok_pairs(aged, fresh[:3], after=0.0)
