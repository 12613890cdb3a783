"""The planner's parts without a cluster: the SLO flags, the performance model (Erlang C,
sizes that grow with the load), the predictors and their errors, observations read from a
real router's metrics, the policy (bounds, cooldowns, the slow way down, corrections), the
local actuator against a stand-in cluster, the fleet model against its own step arithmetic,
and ``splitserve plan`` choosing different P:D ratios for prompt-heavy, output-heavy and
mixed work on the llama3-8b-h100 profile."""

import argparse
import math
import subprocess
import sys

import msgspec
import pytest

from splitserve.common.node_registry import NodeInfo
from splitserve.common.load import NodeLoad
from splitserve.common.sim_profiles import get_deployment
from splitserve.deploy.planner.actuator import LocalPools
from splitserve.deploy.planner.config import dp_bounds
from splitserve.deploy.planner.offline.fleetsim import Req, StepSum, simulate
from splitserve.deploy.planner.offline.search import search
from splitserve.deploy.planner.offline.workload import PRESETS, Phase, as_reqs, generate, parse_phase
from splitserve.deploy.planner.observe import Observation, PoolState, parse_router_metrics
from splitserve.deploy.planner.perf import PoolModel, erlang_c
from splitserve.deploy.planner.scaling import Bounds, Policy, PolicyConfig, significantly_below
from splitserve.deploy.planner.predictor import Ensemble, Holt, MovingAverage
from splitserve.deploy.planner.slo import Slo, add_slo_args, slo_from_args
from splitserve.router.metrics import RouterMetrics

H100 = get_deployment("llama3-8b-h100")
SLO = Slo(1.0, 0.015, 0.9)


# ---- SLO -------------------------------------------------------------------------------------

def parse_slo(*argv: str) -> Slo:
    p = argparse.ArgumentParser()
    add_slo_args(p)
    return slo_from_args(p.parse_args(argv))


def test_slo_flags_and_goodput_terms():
    assert parse_slo("--ttft-p90", "800", "--itl-p90", "20") == Slo(0.8, 0.02, 0.9)
    assert parse_slo("--goodput", "ttft:500", "tpot:40", "--attainment", "0.95") == Slo(0.5, 0.04, 0.95)
    with pytest.raises(ValueError, match="--ttft-p90"):
        parse_slo("--itl-p90", "20")
    with pytest.raises(ValueError, match="unknown term"):
        parse_slo("--goodput", "e2e:5", "ttft:1", "itl:1")
    with pytest.raises(ValueError, match="attainment"):
        Slo(1, 1, 1.0)


# ---- performance model -------------------------------------------------------------------------

def test_erlang_c_known_values():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(4, 0.0) == 0.0


def test_sizes_grow_with_the_load_and_the_correction():
    m = PoolModel(H100, SLO)
    p = [m.size_prefill(rate, 6000, 32).nodes for rate in (1, 4, 8, 16)]
    assert p == sorted(p) and p[0] == 1 and p[-1] > p[1]
    d = [m.size_decode(rate, 300, 900, 32).nodes for rate in (1, 5, 10, 20)]
    assert d == sorted(d) and d[0] == 1 and d[-1] >= 2
    assert m.size_prefill(8, 6000, 32, corr_p=2.0).nodes > m.size_prefill(8, 6000, 32).nodes
    assert m.size_decode(10, 300, 900, 32, corr_d=1.3).nodes > m.size_decode(10, 300, 900, 32).nodes
    s = m.size_prefill(8, 6000, 32)
    assert s.feasible and s.ttft_q_s <= SLO.ttft_s and s.offered < s.nodes
    assert m.size_decode(1, 300, 900, 32).step_s <= 0.85 * SLO.itl_s
    # an ITL bound under the step's floor cannot be met with any number of nodes
    tight = PoolModel(H100, Slo(1.0, 0.005))
    assert not tight.size_decode(1, 300, 900, 4).feasible


# ---- predictors --------------------------------------------------------------------------------

def test_holt_follows_a_ramp_the_moving_average_lags_and_errors_are_scored():
    ma, holt = MovingAverage(4), Holt(0.5, 0.3)
    for y in range(1, 21):
        ma.observe(y)
        holt.observe(y)
    assert abs(holt.forecast() - 21) < 1.0 < abs(ma.forecast() - 21)
    e = Ensemble(window=4)
    for y in range(1, 31):
        e.observe(float(y))
    assert e.chosen().name == "holt"
    errors = e.errors()
    assert errors["holt"]["scored"] == errors["moving_average"]["scored"] == 29
    assert errors["holt"]["mape"] < errors["moving_average"]["mape"]
    flat = Ensemble(window=4)
    for y in [10.0, 10.5, 9.5, 10.0] * 8:
        flat.observe(y)
    assert abs(flat.forecast() - 10) < 1.0


# ---- observation ---------------------------------------------------------------------------------

def test_router_metrics_parse_into_rates_means_and_shares():
    m = RouterMetrics.create("m")
    for ttft in (0.05, 0.3, 0.3, 2.0):
        m.ttft.observe(ttft)
    for tpot in (0.01, 0.02, 0.2):
        m.tpot.observe(tpot)
    m.decisions.labels(node_id="d0", role="decode").inc(4)
    m.decisions.labels(node_id="p0", role="prefill").inc(4)
    m.prompt_tokens.inc(4000)
    m.request_generation_tokens.observe(10)
    t = parse_router_metrics(m.render()[0].decode())
    assert t.routed == 4 and t.prompt_tokens == 4000
    assert t.ttft.n == 4 and t.ttft.mean() == pytest.approx(2.65 / 4)
    assert t.ttft.share_at_most(1.0) == pytest.approx(0.75)
    assert t.itl.share_at_most(0.05) == pytest.approx(2 / 3)
    assert t.output_tokens.mean() == 10
    empty = parse_router_metrics(RouterMetrics.create("m").render()[0].decode())
    assert t.ttft.minus(empty.ttft).n == 4 and empty.ttft.share_at_most(1.0) is None


# ---- policy --------------------------------------------------------------------------------------

def obs(rate: float, isl: float = 6000, osl: float = 40, prefill: int = 1, decode: int = 1, ttft=None,
        itl=None, finished: int = 0, decode_running: int = 0, ttft_ok=None, by_node: tuple[int, ...] = ()) -> Observation:
    return Observation(at=0.0, interval_s=10.0, rate=rate, isl=isl if rate else None, osl=osl if rate else None,
                       ttft_mean=ttft, ttft_ok=ttft_ok, itl_mean=itl, itl_ok=None, finished=finished, failures=0,
                       in_flight=0, pools={"prefill": PoolState(prefill, 0, 0, 0, 0.0),
                                           "decode": PoolState(decode, decode_running, 0, 0, 0.0, by_node)},
                       routers=1, ttft_n=finished, itl_n=finished)


def test_policy_scales_up_at_once_and_down_slowly_within_bounds():
    cfg = PolicyConfig(Bounds(1, 4, 1, 3), cooldown_up_s=0, cooldown_down_s=30, down_after=2, rate_window=1)
    pol = Policy(PoolModel(H100, SLO), cfg)
    d = pol.decide(obs(12), {"prefill": 1, "decode": 1}, now=0)
    assert d.target["prefill"] == d.sizing["prefill"].nodes == 3 and d.change["prefill"] == 2
    d = pol.decide(obs(40, prefill=3), {"prefill": 3, "decode": 1}, now=10)
    assert d.target["prefill"] == 4 and not d.sizing["prefill"].feasible  # bounded; said why
    assert any("out of reach" in r for r in d.reasons)
    quiet = [pol.decide(obs(0, prefill=4), {"prefill": 4, "decode": 1}, now=t) for t in (20, 30, 40, 50)]
    assert [q.change["prefill"] for q in quiet] == [0, 0, -3, 0]  # cooldown from t=10, then 2 in a row
    assert quiet[2].target["prefill"] == 1 and quiet[2].current["prefill"] == 4  # to the target at once
    raw = msgspec.json.decode(msgspec.json.encode(quiet[2]))
    assert raw["observed"]["rate"] == 0 and raw["sizing"]["prefill"]["nodes"] >= 0


def test_a_data_parallel_pool_moves_by_whole_nodes():
    """Nodes of 2 DP ranks: the pool counts ranks (each a node of the pool, as the profiles' are)
    and grows and shrinks by whole nodes; the flags' bounds are rounded to them, or refused."""
    cfg = PolicyConfig(Bounds(2, 4, 1, 3), cooldown_up_s=0, cooldown_down_s=0, down_after=1, down_step=1,
                       rate_window=1, prefill_dp=2)
    pol = Policy(PoolModel(H100, SLO), cfg)
    d = pol.decide(obs(12, prefill=2), {"prefill": 2, "decode": 1}, now=0)
    assert d.sizing["prefill"].nodes == 3 and d.target["prefill"] == 4 and d.change["prefill"] == 2
    d = pol.decide(obs(0, prefill=4), {"prefill": 4, "decode": 1}, now=10)
    assert d.target["prefill"] == 2 and d.change["prefill"] == -2  # a down step of 1 is one node of 2
    assert dp_bounds(1, 5, 2, "decode", "planner-") == (2, 4)
    with pytest.raises(ValueError, match="--planner-max-decode 1: a decode node of --decode-dp 2 is 2 ranks"):
        dp_bounds(1, 1, 2, "decode", "planner-")
    with pytest.raises(ValueError, match="whole nodes of 2"):
        PolicyConfig(Bounds(1, 4, 1, 3), prefill_dp=2)
    # up refuses such bounds before it starts anything
    up = subprocess.run([sys.executable, "-m", "splitserve.cli", "up", "--decode-dp", "2", "--planner",
                         "--planner-max-decode", "1"], capture_output=True, text=True, timeout=60)
    assert up.returncode == 2 and "error: --planner-max-decode 1: a decode node of --decode-dp 2" in up.stderr, up


def test_a_backlog_on_the_prefill_nodes_keeps_them_through_an_interval_without_arrivals():
    """A burst ends but its prompts still queue on the prefill nodes: an interval with no new
    requests does not drain them (that backlog would wait on fewer nodes, and the planner would
    start one again once the late first tokens show the miss); once it is computed they go."""
    cfg = PolicyConfig(Bounds(1, 4, 1, 3), cooldown_up_s=0, cooldown_down_s=0, down_after=1)
    pol = Policy(PoolModel(H100, SLO), cfg)
    prompts = round(2.9 * SLO.ttft_s / pol.model.prefill_seconds(6000))  # three nodes start them within the bound
    quiet = obs(0, prefill=4)
    busy = quiet._replace(pools={**quiet.pools, "prefill": PoolState(4, 4, prompts - 4, 6000 * prompts, 0.5)})
    d = pol.decide(busy, {"prefill": 4, "decode": 1}, now=0)
    assert d.target["prefill"] == 3 and d.change["prefill"] == -1  # shrinks only to what the backlog needs
    assert any("queued on the prefill nodes" in r for r in d.reasons)
    d = pol.decide(quiet._replace(pools={**quiet.pools, "prefill": PoolState(3, 0, 0, 0, 0.0)}),
                   {"prefill": 3, "decode": 1}, now=10)
    assert d.target["prefill"] == 1 and d.change["prefill"] < 0  # computed: the quiet pool shrinks


def test_corrections_follow_what_the_pools_deliver():
    pol = Policy(PoolModel(H100, SLO), PolicyConfig(Bounds(1, 16, 1, 16), min_samples=3, corr_window=1))
    model_ttft = pol.model.ttft(4, 6000, 2)
    pol.decide(obs(4, prefill=2, ttft=2 * model_ttft, finished=10, decode_running=20), {"prefill": 2, "decode": 1},
               now=100)
    assert 1.3 < pol.corr["prefill"] < 2.5  # the pool is slower than the profile says
    step = pol.model.decode_step(20, 300, 1.0, 900)
    pol.decide(obs(4, 300, 900, prefill=2, itl=0.8 * step, finished=10, decode_running=20),
               {"prefill": 2, "decode": 1}, now=200)
    assert pol.corr["decode"] == pytest.approx(0.8, abs=0.01)
    before = dict(pol.corr)
    pol.decide(obs(4, prefill=1, ttft=10.0, finished=10), {"prefill": 2, "decode": 1}, now=300)
    assert pol.corr["prefill"] == before["prefill"]  # a node still starting: not the profile's error


def test_a_miss_is_one_beyond_chance():
    assert not significantly_below(0.8, 5, 0.95)  # one slow request of five
    assert not significantly_below(0.857, 7, 0.95) and not significantly_below(1.0, 3, 0.95)
    assert significantly_below(0.625, 8, 0.95) and significantly_below(0.9, 200, 0.95)
    assert not significantly_below(None, 0, 0.95)
    # the policy: the sizing wants one more prefill node, up_after asks for 3 decisions in a row;
    # an interval with 1 of 5 first tokens late does not jump the queue, 3 of 8 late does
    cfg = PolicyConfig(Bounds(1, 16, 1, 16), cooldown_up_s=0, up_after=3, min_samples=5)
    for late, n, jumps in ((1, 5, False), (3, 8, True)):
        pol = Policy(PoolModel(H100, SLO), cfg)
        d = pol.decide(obs(12, prefill=2, finished=n, ttft_ok=1 - late / n), {"prefill": 2, "decode": 1}, now=0)
        assert d.target["prefill"] == 3 and (d.change["prefill"] == 1) == jumps, d.reasons


def test_a_correction_pools_its_intervals_by_their_requests():
    cfg = PolicyConfig(Bounds(1, 16, 1, 16), min_samples=3, corr_window=5)
    pol = Policy(PoolModel(H100, SLO), cfg)
    model_ttft = pol.model.ttft(4, 6000, 2)
    # 40 requests as the profile says, then 3 at three times its TTFT: the 40 weigh more
    pol.decide(obs(4, prefill=2, ttft=model_ttft, finished=40), {"prefill": 2, "decode": 1}, now=100)
    assert pol.corr["prefill"] == pytest.approx(1.0, abs=0.01)
    pol.decide(obs(4, prefill=2, ttft=3 * model_ttft, finished=3), {"prefill": 2, "decode": 1}, now=200)
    assert 1.0 < pol.corr["prefill"] < 1.2
    # decode: 2 nodes, one running 30 requests and one 0 (a pool just grown); the ITL the
    # requests see is the step of 30, the profile's: no correction
    step30 = pol.model.decode_step(30, 300, 1.0, 900)
    pol = Policy(PoolModel(H100, SLO), cfg)
    pol.decide(obs(4, 300, 900, prefill=2, decode=2, itl=step30, finished=10, decode_running=30, by_node=(30, 0)),
               {"prefill": 2, "decode": 2}, now=300)
    assert pol.corr["decode"] == pytest.approx(1.0, abs=0.01)
    even = Policy(PoolModel(H100, SLO), cfg)  # the same ITL spread evenly would say the profile is slow
    even.decide(obs(4, 300, 900, prefill=2, decode=2, itl=step30, finished=10, decode_running=30, by_node=(15, 15)),
                {"prefill": 2, "decode": 2}, now=300)
    assert even.corr["decode"] > 1.05


# ---- the local actuator --------------------------------------------------------------------------

class FakeProc:
    def __init__(self, name):
        self.name, self.code = name, None
        self.popen = self

    def poll(self):
        return self.code


class FakeCluster:
    """deploy/launcher.py Cluster's members and names, without processes; ``dp``: role -> ranks
    of one node (its data-parallel size)."""
    def __init__(self, dp=None):
        self.dp = dp or {}
        self.procs = [FakeProc(n) for role in ("prefill", "decode") for n in self.node_members(role, 0)]
        self.procs.append(FakeProc("router"))
        self.retired: set[str] = set()

    def node(self, name):
        return next(p for p in reversed(self.procs) if p.name == name)

    def dp_size(self, role):
        return self.dp.get(role, 1)

    def node_members(self, role, node):
        return [f"{role}-{node * self.dp_size(role) + r}" for r in range(self.dp_size(role))]

    def start_members(self, role, node):
        self.procs += [FakeProc(n) for n in self.node_members(role, node)]
        return self.procs[-self.dp_size(role):]

    def retire_members(self, role, node):
        self.retired.update(self.node_members(role, node))
        return self.node_members(role, node)

    def node_id_of(self, name):
        return name


def node(node_id: str, role: str, running: int) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, http_addr="", model="m", epoch="e", load=NodeLoad(running=running))


def test_local_pools_start_fresh_names_drain_the_least_loaded_and_count_device_seconds():
    import asyncio

    clock = [0.0]
    cluster = FakeCluster()
    pools = LocalPools(cluster, {"prefill": 2, "decode": 1}, clock=lambda: clock[0])
    assert pools.counts([]) == {"prefill": 1, "decode": 1}
    asyncio.run(pools.apply({"prefill": 2, "decode": 0}, []))
    assert [p.name for p in cluster.procs][-2:] == ["prefill-1", "prefill-2"]
    clock[0] = 10.0
    busy = [node("prefill-0", "prefill", 3), node("prefill-1", "prefill", 0), node("prefill-2", "prefill", 1)]
    did = asyncio.run(pools.apply({"prefill": -1}, busy))
    assert did == ["draining prefill-1 (load 0)"] and cluster.retired == {"prefill-1"}
    assert pools.counts(busy) == {"prefill": 2, "decode": 1}  # a draining node no longer counts
    clock[0] = 15.0
    cluster.node("prefill-1").code = 0
    state = {n["name"]: n for n in pools.state()["nodes"]}
    assert state["prefill-1"]["state"] == "stopped" and state["prefill-1"]["exit_code"] == 0
    asyncio.run(pools.apply({"prefill": 1}, []))
    assert cluster.procs[-1].name == "prefill-3"  # a name is never reused
    # prefill: 0 and 2 for 15 s, 1 for 15 s, 3 from t=15: x 2 devices; decode: 15 s
    assert pools.device_seconds(until=15.0) == {"prefill": 2 * (15 + 15 + 15 + 0), "decode": 15.0}


def test_local_pools_start_and_drain_a_data_parallel_node_whole():
    import asyncio

    cluster = FakeCluster(dp={"decode": 2})
    pools = LocalPools(cluster)
    assert pools.counts([]) == {"prefill": 1, "decode": 2}  # ranks: each a node of the pool
    assert asyncio.run(pools.apply({"decode": 2}, [])) == ["started decode-2, decode-3"]
    busy = [node("decode-0", "decode", 3), node("decode-1", "decode", 0), node("decode-2", "decode", 1),
            node("decode-3", "decode", 1)]
    did = asyncio.run(pools.apply({"decode": -2}, busy))  # decode-1 is the idlest rank, but never goes alone
    assert did == ["draining decode-2, decode-3 (load 2)"] and cluster.retired == {"decode-2", "decode-3"}
    assert pools.counts(busy) == {"prefill": 1, "decode": 2}
    assert asyncio.run(pools.apply({"decode": -2}, busy)) == []  # the last decode node stays
    assert asyncio.run(pools.apply({"decode": 2}, [])) == ["started decode-4, decode-5"]  # numbers never reused


# ---- the fleet model and the plan ---------------------------------------------------------------

@pytest.mark.parametrize("profile", ["llama3-8b-h100", "smollm2-135m-cpu", "llama3-70b-tp8-h100"])
def test_step_sums_in_closed_form_equal_the_steps(profile):
    steps = StepSum(get_deployment(profile).decode)
    for b, c0, n in [(1, 100, 7), (64, 64 * 2000, 300), (200, 200 * 30000, 50), (8, 8 * 120000, 40)]:
        assert steps.total(b, c0, n) == pytest.approx(sum(steps.one(b, c0 + i * b) for i in range(n)), rel=1e-9)


def test_a_lone_request_takes_its_prefill_then_one_step_per_token():
    d = H100
    r = simulate([Req(1.0, 3000, 11)], d, 1, 1)
    assert r.ttft[0] == pytest.approx(d.prefill.prefill_seconds(3000))
    steps = StepSum(d.decode)
    assert r.itl[0] == pytest.approx(steps.total(1, 3001, 10) / 10)
    # two prompts at once on one prefill node share its steps; a second node takes one each
    both = [Req(0.0, 3000, 2), Req(0.0, 3000, 2)]
    assert max(simulate(both, d, 1, 1).ttft) > max(simulate(both, d, 2, 1).ttft)


def test_workload_phases_and_their_parsing():
    trace = generate([Phase(100, 2.0, 500, 50, 0.0), Phase(100, 4.0, 100, 200, 0.0)], seed=3)
    first = [r for r in trace if r.timestamp < 100_000]
    assert 150 < len(first) < 250 and 300 < len(trace) - len(first) < 500
    assert {(r.input_length, r.output_length) for r in first} == {(500, 50)}
    assert len({h for r in trace for h in r.hash_ids}) == sum(len(r.hash_ids) for r in trace)  # no shared prefix
    assert parse_phase("60:2:100:50") == Phase(60, 2, 100, 50)
    with pytest.raises(ValueError, match="DURATION:RATE:IN:OUT"):
        parse_phase("60:2:100")
    assert as_reqs(trace)[0].arrival == 0.0


def test_plan_picks_different_pd_ratios_for_the_three_workloads():
    ratios = {}
    for name in ("prompt-heavy", "output-heavy", "mixed"):
        result = search(as_reqs(generate(PRESETS[name], seed=0)), H100, SLO, explore_tp=False)
        b = result.best
        assert b is not None and b.meets and b.ttft_ok >= 0.9 and b.itl_ok >= 0.9
        cheaper = [c for c in result.evaluated if c.devices < b.devices]
        assert cheaper and not any(c.meets for c in cheaper)  # nothing cheaper that was tried meets it
        ratios[name] = b.prefill_nodes / b.decode_nodes
    assert ratios["prompt-heavy"] > ratios["mixed"] > ratios["output-heavy"], ratios


def test_plan_explores_tp_per_pool_and_the_cli_writes_json_and_plot(tmp_path):
    reqs = as_reqs(generate([Phase(60, 3.0, 8000, 400)], seed=1))
    result = search(reqs, get_deployment("llama3-70b-tp4-h100"), Slo(2.0, 0.05), max_nodes=8)
    assert {(c.prefill_profile, c.decode_profile) for c in result.evaluated} >= {
        ("llama3-70b-tp4-h100", "llama3-70b-tp8-h100"), ("llama3-70b-tp8-h100", "llama3-70b-tp4-h100")}
    assert result.best is not None and result.best.devices % 4 == 0
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "-m", "splitserve.cli", "plan", "--workload", "mixed", "--ttft-p90",
                          "1000", "--itl-p90", "15", "--no-explore-tp", "--result-json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "the cheapest that meets the SLO" in run.stdout
    import json
    data = json.loads(out.read_text())
    assert data["best"]["meets"] and data["evaluated"] and out.with_suffix(".png").stat().st_size > 1000
    bad = subprocess.run([sys.executable, "-m", "splitserve.cli", "plan", "--workload", "mixed"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--ttft-p90" in bad.stderr
    assert math.isfinite(data["best"]["ttft_q_s"])
