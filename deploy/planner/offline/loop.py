"""The online planner in a closed loop with the fleet model: the real ``Policy``
(scaling.py) decides every ``interval_s`` on observations the fleet model makes, and its
changes start and drain modelled nodes. A policy is tried on a trace in a second instead
of a replay on simulated nodes for minutes, so it can be judged on many seeds of a load's
family (``benchmarks/planner/bench_online.py --model-only``) and tested on a shift of
the load (tests/test_planner_loop.py).

    nodes     fleetsim.py's prefill and decode nodes; a started node takes requests
              ``startup_s`` after the decision (a node process's start and registration);
              a drained one takes no new request, finishes its own and exits. The
              router sends each request to the least loaded node serving (fleetsim.py)
    observe   each interval what the routers' metrics and the node registry would show:
              arrivals (rate, mean prompt), first tokens (TTFT mean, share within the
              bound), finished requests (output length, ITL), and per role the nodes
              registered, running, waiting, queued prompt tokens and the tokens the
              running requests generated so far
    decide    Policy.decide with the nodes serving or starting; a drain takes a node not
              yet serving first, then the least loaded (as actuator.LocalPools does)
    cost      device-seconds: each node from its start (or 0) to its exit

Not modelled beyond fleetsim.py: a drain's grace and migration (a drained node finishes
everything), the router's retries. Must not talk to a cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ....common.sim_profiles import SimDeployment
from ..observe import Observation, PoolState
from ..scaling import ROLES, PlanningDecision, Policy
from .fleetsim import DecodeSim, PrefillSim, Req, StepSum, Track

STARTUP_S = 8.0  # a simulated node's start to its first request (bench_online's runs: ~8 trace s)


@dataclass(slots=True)
class Node:
    sim: PrefillSim | DecodeSim
    started: float
    ready: float  # takes requests from then on
    drained: float = math.inf  # asked to drain at
    exited: float = math.nan  # its last request done after the drain

    def serving(self, t: float) -> bool:
        return self.ready <= t and t < self.drained


class LoopResult(NamedTuple):
    ttft: list[float]  # per request, seconds
    itl: list[float]  # per request: mean inter-token latency (nan for one-token answers)
    device_s: dict[str, float]  # role -> node-seconds, start to exit
    decisions: list[PlanningDecision]
    timeline: list[tuple[float, int, int]]  # (decision time, prefill, decode nodes serving or starting after it)
    span_s: float  # first arrival to last answer


def simulate_planner(reqs: list[Req], deployment: SimDeployment, policy: Policy, start: tuple[int, int],
                     interval_s: float, startup_s: float = STARTUP_S) -> LoopResult:
    """``reqs`` (sorted by arrival) on a fleet that starts at ``start`` = (prefill, decode)
    nodes and that ``policy`` resizes every ``interval_s`` (its cooldowns in the trace's
    seconds: ``policy.time_scale`` 1)."""
    tracks = [Track() for _ in reqs]
    isls = [r.isl for r in reqs]
    steps = StepSum(deployment.decode)
    pools: dict[str, list[Node]] = {"prefill": [], "decode": []}

    def add(role: str, t: float, ready: float) -> None:
        sim = (PrefillSim(deployment.prefill, tracks, isls) if role == "prefill"
               else DecodeSim(deployment.decode, steps, tracks, reqs))
        sim.clock = ready
        pools[role].append(Node(sim, t, ready))

    for role, n in zip(ROLES, start):
        for _ in range(n):
            add(role, 0.0, 0.0)
    owner = [-1] * len(reqs)  # request -> index of its decode node
    done: list[tuple[float, int]] = []

    def advance(t: float) -> None:
        for sim in prefills(pools["prefill"]):
            sim.advance(t, done)
        decodes_ = pools["decode"]
        for ft, i in done:
            target = decodes_[owner[i]].sim
            assert isinstance(target, DecodeSim)
            target.join(ft, i)
        done.clear()
        for dsim in decodes(decodes_):
            dsim.advance(t)
        for role, nodes in pools.items():
            for node in nodes:
                if node.drained <= t and node.drained < math.inf and math.isnan(node.exited) and idle(node.sim):
                    node.exited = max(node.drained, node.sim.clock)

    decisions: list[PlanningDecision] = []
    timeline: list[tuple[float, int, int]] = []
    tick, last_tick, i = interval_s, 0.0, 0
    first_seen, finish_seen = [False] * len(reqs), [False] * len(reqs)
    while True:
        if i < len(reqs) and reqs[i].arrival < tick:
            r = reqs[i]
            advance(r.arrival)
            p = _least(pools["prefill"], r.arrival, lambda s: s.assigned, i)
            d = _least(pools["decode"], r.arrival, lambda s: s.assigned, i)
            owner[i] = d
            dec, pre = pools["decode"][d].sim, pools["prefill"][p].sim
            assert isinstance(dec, DecodeSim) and isinstance(pre, PrefillSim)
            dec.assigned += 1
            dec.reserve(r.isl)
            pre.add(i, r.isl, r.arrival)
            i += 1
            continue
        advance(tick)
        obs = _observe(reqs, tracks, pools, owner, last_tick, tick, i, first_seen, finish_seen, policy)
        current = {role: sum(n.drained > tick for n in pools[role]) for role in ROLES}
        if i == len(reqs) and obs.in_flight == 0:
            break
        decision = policy.decide(obs, current, now=tick)
        decisions.append(decision)
        for role in ROLES:
            change = decision.change.get(role, 0)
            for _ in range(max(0, change)):
                add(role, tick, tick + startup_s)
            for _ in range(max(0, -change)):
                live = [n for n in pools[role] if n.drained > tick]
                victim = min(live, key=lambda n: (n.ready <= tick, load(n.sim)))
                victim.drained = tick
        live_p, live_d = (sum(n.drained > tick for n in pools[role]) for role in ROLES)
        timeline.append((tick, live_p, live_d))
        last_tick, tick = tick, tick + interval_s
    advance(math.inf)
    span_end = max((t.finish for t in tracks), default=0.0)  # the run ends with its last answer
    for nodes in pools.values():
        for node in nodes:
            if math.isnan(node.exited):
                node.exited = span_end if node.drained == math.inf else max(node.drained, node.sim.clock)
    device_s = {role: sum(n.exited - n.started for n in pools[role]) for role in ROLES}
    ttft = [t.first - r.arrival for t, r in zip(tracks, reqs)]
    itl = [(t.finish - t.first) / (r.osl - 1) if r.osl > 1 else math.nan for t, r in zip(tracks, reqs)]
    return LoopResult(ttft, itl, device_s, decisions, timeline, span_end - (reqs[0].arrival if reqs else 0.0))


def idle(sim: PrefillSim | DecodeSim) -> bool:
    if isinstance(sim, PrefillSim):
        return not sim.waiting and not sim.running
    return sim.assigned == 0


def load(sim: PrefillSim | DecodeSim) -> int:
    """What LocalPools drains by: running + waiting + queued prompt tokens."""
    if isinstance(sim, PrefillSim):
        return len(sim.running) + len(sim.waiting) + sim.assigned
    return sim.assigned


def _least(nodes: list[Node], t: float, key, i: int) -> int:
    """The serving node of least ``key(sim)`` (ties: round robin from request ``i``); the
    earliest to be ready when none serves yet."""
    serving = [k for k, n in enumerate(nodes) if n.serving(t)]
    if not serving:
        live = [k for k, n in enumerate(nodes) if n.drained > t]
        return min(live, key=lambda k: nodes[k].ready)
    return min(serving, key=lambda k: (key(nodes[k].sim), (k - i) % len(nodes)))


def _observe(reqs: list[Req], tracks: list[Track], pools: dict[str, list[Node]], owner: list[int],
             t0: float, t1: float, arrived: int, first_seen: list[bool], finish_seen: list[bool],
             policy: Policy) -> Observation:
    slo = policy.model.slo
    new = [r for r in reqs[:arrived] if t0 <= r.arrival < t1]
    ttfts, itls, osls = [], [], []
    for k in range(arrived):
        tr = tracks[k]
        if not first_seen[k] and tr.first <= t1:
            first_seen[k] = True
            ttfts.append(tr.first - reqs[k].arrival)
        if not finish_seen[k] and tr.finish <= t1:
            finish_seen[k] = True
            osls.append(reqs[k].osl)
            if reqs[k].osl > 1:
                itls.append((tr.finish - tr.first) / (reqs[k].osl - 1))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    share = lambda xs, bound: sum(x <= bound for x in xs) / len(xs) if xs else None  # noqa: E731
    serving = {role: [n for n in pools[role] if n.serving(t1)] for role in ROLES}
    pre, dec = prefills(serving["prefill"]), decodes(serving["decode"])
    running = tuple(len(s.ends) for s in dec)
    states = {
        "prefill": PoolState(len(pre), sum(len(s.running) for s in pre), sum(len(s.waiting) for s in pre),
                             sum(s.assigned for s in pre), 0.0, tuple(len(s.running) for s in pre)),
        "decode": PoolState(len(dec), sum(running), sum(len(s.joins) + len(s.kv_wait) for s in dec), 0,
                            sum(s.kv_used / s.profile.kv_pool_tokens for s in dec) / max(1, len(dec)), running,
                            sum(s.generated() for s in dec)),
    }
    in_flight = sum(1 for k in range(arrived) if not finish_seen[k])
    dt = t1 - t0
    return Observation(
        at=t1, interval_s=dt, rate=len(new) / dt, isl=mean([r.isl for r in new]), osl=mean(osls),
        ttft_mean=mean(ttfts), ttft_ok=share(ttfts, slo.ttft_s), itl_mean=mean(itls), itl_ok=share(itls, slo.itl_s),
        finished=len(osls), failures=0.0, in_flight=in_flight, pools=states, routers=1,
        ttft_n=len(ttfts), itl_n=len(itls))


def prefills(nodes: list[Node]) -> list[PrefillSim]:
    return [n.sim for n in nodes if isinstance(n.sim, PrefillSim)]


def decodes(nodes: list[Node]) -> list[DecodeSim]:
    return [n.sim for n in nodes if isinstance(n.sim, DecodeSim)]
