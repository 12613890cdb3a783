"""The online planner's policy in a closed loop with the fleet model
(deploy/planner/offline/loop.py): the loop at fixed bounds is the fleet model itself; a
flip of the mix (long prompts / short answers -> short prompts / long answers) grows the
decode pool within two intervals, before any minute's ITL attainment falls below 90%; and
within the hysteresis band the load's noise moves no pool."""

import math

import pytest

from splitserve.deploy.planner.sim_profiles import get_deployment
from splitserve.deploy.planner.observe import Observation, PoolState
from splitserve.deploy.planner.offline.fleetsim import simulate
from splitserve.deploy.planner.offline.loop import simulate_planner
from splitserve.deploy.planner.offline.workload import Phase, as_reqs, generate
from splitserve.deploy.planner.perf import PoolModel
from splitserve.deploy.planner.scaling import Bounds, Policy, PolicyConfig
from splitserve.deploy.planner.slo import Slo

CPU = get_deployment("smollm2-135m-cpu")
SLO = Slo(15.0, 0.35, 0.95)  # bench_online.py's
INTERVAL = 15.0


def flip_trace(seed: int, half: float = 600.0):
    return as_reqs(generate([Phase(half, 0.4, 1500, 16, 0.4), Phase(half, 0.8, 150, 250, 0.4)], seed=seed,
                            context=CPU.context))


def bench_policy(**kw) -> Policy:
    cfg = PolicyConfig(Bounds(1, 8, 1, 8), cooldown_up_s=INTERVAL, cooldown_down_s=2 * INTERVAL, down_after=4,
                       up_after=2, rate_window=8, **kw)
    return Policy(PoolModel(CPU, SLO), cfg)


def test_the_loop_at_fixed_bounds_is_the_fleet_model():
    reqs = flip_trace(0, half=240.0)
    pol = Policy(PoolModel(CPU, SLO), PolicyConfig(Bounds(3, 3, 2, 2)))
    res = simulate_planner(reqs, CPU, pol, (3, 2), INTERVAL)
    ref = simulate(reqs, CPU, 3, 2)
    assert res.ttft == pytest.approx(ref.ttft, abs=1e-9)
    assert [x for x in res.itl if not math.isnan(x)] == pytest.approx([x for x in ref.itl if not math.isnan(x)],
                                                                         abs=1e-9)
    assert all(sum(d.change.values()) == 0 for d in res.decisions)
    assert res.device_s["prefill"] == pytest.approx(3 * res.span_s, rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_grows_within_two_intervals_of_a_mix_flip(seed):
    half = 600.0
    reqs = flip_trace(seed, half)
    res = simulate_planner(reqs, CPU, bench_policy(), (4, 1), INTERVAL)
    before = max(n_d for t, _, n_d in res.timeline if t <= half)
    after = [n_d for t, _, n_d in res.timeline if half < t <= half + 2 * INTERVAL]
    assert max(after) > before, (before, after)
    minutes: dict[int, list[float]] = {}
    for r, itl in zip(reqs, res.itl):
        if not math.isnan(itl):
            minutes.setdefault(int(r.arrival // 60), []).append(itl)
    worst = min(sum(x <= SLO.itl_s for x in v) / len(v) for v in minutes.values())
    assert worst >= 0.9, worst
    # what moved it: the answers running on the decode nodes, or the requests piling up there
    flip = [d for d in res.decisions if half < d.seq * INTERVAL <= half + 2 * INTERVAL]
    assert any("running requests' answers" in r or "requests on the decode nodes" in r
               for d in flip for r in d.reasons)


def obs(rate: float, prefill: int, decode: int = 1) -> Observation:
    return Observation(at=0.0, interval_s=INTERVAL, rate=rate, isl=1500, osl=16, ttft_mean=None, ttft_ok=None,
                       itl_mean=None, itl_ok=None, finished=0, failures=0, in_flight=0,
                       pools={"prefill": PoolState(prefill, 0, 0, 0, 0.0), "decode": PoolState(decode, 0, 0, 0, 0.0)},
                       routers=1)


def test_the_hysteresis_band_holds_a_pool_through_noise_and_leaves_it_past_the_band():
    cfg = PolicyConfig(Bounds(1, 16, 1, 16), cooldown_up_s=0, cooldown_down_s=0, up_after=1, down_after=1,
                       rate_window=1, hysteresis=0.2)
    model = PoolModel(CPU, SLO)

    def size(rate: float, margin: float) -> int:
        return model.size_prefill(rate, 1500, 16, margin=margin).nodes

    grow, keep = size(0.4, 0.0), size(0.4, 0.2)
    assert grow < keep  # the band: grow meets the bound, keep meets it with 20% to spare
    for current, want in ((grow - 1, grow), (grow, grow), (keep, keep), (keep + 1, keep)):
        d = Policy(model, cfg).decide(obs(0.4, current), {"prefill": current, "decode": 1}, now=0)
        assert d.target["prefill"] == want and d.change["prefill"] == want - current, (current, d.reasons)
        assert d.sizing["prefill"].nodes == grow and d.sizing["prefill"].keep == keep
    # +-10% of noise around 0.45 requests/s: 5 nodes are within the band at both ends, while
    # the bare sizes alternate between 4 and 5
    rate, pool, noise = 0.45, 5, [1.1, 0.9] * 10
    assert size(rate * 1.1, 0.0) <= pool <= size(rate * 0.9, 0.2) and size(rate * 0.9, 0.0) < pool
    pol = Policy(model, cfg)
    changes = [pol.decide(obs(rate * f, pool), {"prefill": pool, "decode": 1}, now=t).change["prefill"]
               for t, f in enumerate(noise)]
    assert changes == [0] * len(noise)
    flat = Policy(model, PolicyConfig(cfg.bounds, cooldown_up_s=0, cooldown_down_s=0, up_after=1, down_after=1,
                                      rate_window=1, hysteresis=0.0))
    current, moves = pool, []
    for t, f in enumerate(noise):
        c = flat.decide(obs(rate * f, current), {"prefill": current, "decode": 1}, now=t).change["prefill"]
        current += c
        moves.append(c)
    assert any(m > 0 for m in moves) and any(m < 0 for m in moves)  # without the band: it oscillates


def test_running_answers_raise_the_output_length_before_any_finishes():
    pol = Policy(PoolModel(CPU, SLO), PolicyConfig(Bounds(1, 8, 1, 8), rate_window=1))
    quiet = obs(0.8, 1)
    pools = {"prefill": PoolState(1, 0, 0, 0, 0.0), "decode": PoolState(1, 12, 0, 0, 0.1, (12,), 12 * 100)}
    d = pol.decide(quiet._replace(isl=150, pools=pools), {"prefill": 1, "decode": 1}, now=0)
    assert d.predicted["osl"] == pytest.approx(150)  # 1.5 x the 100 tokens each has so far; the finished say 16
    assert any("running requests' answers" in r for r in d.reasons)
    assert d.sizing["decode"].nodes >= 2
