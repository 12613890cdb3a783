"""The search behind ``splitserve plan``: the cheapest fleet (devices) whose modelled
TTFT and ITL attainment (fleetsim.py) both reach the SLO's, for one workload.

    pairings      the deployment as named, or with ``explore_tp`` every pair of profiles
                  of its model, dtype and block size (e.g. prefill TP4 or TP8, decode TP4
                  or TP8; a MoE model's 1-GPU EP1 or 2-GPU EP2 profile; DeepSeek-V3's DP8,
                  DP16, DP32 or TP8 nodes): the "TP, EP and DP per pool" choice, reported
                  as each pool's profile, EP and DP size
    DP nodes      a pool of a data-parallel profile grows by whole nodes of dp ranks: P and D
                  count nodes, the model runs P x dp (D x dp) simulated ranks, each one GPU
    per pairing   P* = the fewest prefill nodes whose TTFT attainment reaches the SLO with
                  plenty of decode nodes; D* = the fewest decode nodes whose ITL attainment
                  reaches it with plenty of prefill nodes (each pool barely touches the
                  other's latency); then (P*, D*) and its neighbours together, growing
                  the pool that misses until both reach it
    cost          P x devices per prefill node + D x devices per decode node (a DP node: its gpus)
    best          the cheapest configuration that meets both (ties: the higher worst
                  attainment); alternatives: the next cheapest that meet, then the best
                  near misses

Starting points and "plenty" come from perf.py's analytic sizes. Must not talk to a cluster.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..sim_profiles import SimDeployment, SimProfile, load_profiles, pair
from ..perf import PoolModel
from ..slo import Slo
from .fleetsim import Req, simulate


class Candidate(NamedTuple):
    prefill_profile: str
    decode_profile: str
    prefill_nodes: int
    decode_nodes: int
    devices: int  # the cost
    ttft_ok: float  # share of requests whose first token came within the SLO
    itl_ok: float  # share of requests whose mean inter-token latency met it (one-token answers do)
    ttft_q_s: float  # TTFT at the SLO's quantile
    itl_q_s: float
    prefill_util: float  # mean busy share of the prefill nodes over the run
    decode_util: float
    meets: bool
    prefill_ep: int = 0  # the prefill profile's expert-parallel size; 0: a dense model
    decode_ep: int = 0
    prefill_dp: int = 1  # data-parallel ranks per prefill node (nodes x dp simulated ranks)
    decode_dp: int = 1

    @property
    def worst(self) -> float:
        return min(self.ttft_ok, self.itl_ok)

    def label(self) -> str:
        tp = (f" (prefill {self.prefill_profile}, decode {self.decode_profile})"
              if self.prefill_profile != self.decode_profile else "")
        def one(ep: int, dp: int) -> str:
            return f"DP{dp}/EP{ep}" if dp > 1 else f"EP{ep}"
        ep = f" {one(self.prefill_ep, self.prefill_dp)}:{one(self.decode_ep, self.decode_dp)}" if self.prefill_ep else ""
        return f"{self.prefill_nodes}P:{self.decode_nodes}D{ep}{tp}"


class PlanResult(NamedTuple):
    best: Candidate | None
    alternatives: list[Candidate]
    evaluated: list[Candidate]  # every configuration tried, cheapest first


def devices(profile_gpus: int) -> int:
    return max(1, profile_gpus)  # a CPU node is one device


def quantile(values: list[float], q: float) -> float:
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def evaluate(reqs: list[Req], dep: SimDeployment, p: int, d: int, slo: Slo) -> Candidate:
    """``p`` prefill and ``d`` decode nodes (a DP node: dp simulated ranks)."""
    pr, dr = p * dep.prefill.dp, d * dep.decode.dp
    r = simulate(reqs, dep, pr, dr)
    n = len(reqs)
    ttft_ok = sum(t <= slo.ttft_s for t in r.ttft) / n
    itl_ok = sum(math.isnan(x) or x <= slo.itl_s for x in r.itl) / n
    span = max(r.span_s, 1e-9)
    return Candidate(dep.prefill.name, dep.decode.name, p, d,
                     p * devices(dep.prefill.gpus) + d * devices(dep.decode.gpus),
                     round(ttft_ok, 4), round(itl_ok, 4), round(quantile(r.ttft, slo.attainment), 4),
                     round(quantile(r.itl, slo.attainment), 5),
                     round(sum(r.prefill_busy) / (pr * span), 4), round(sum(r.decode_busy) / (dr * span), 4),
                     ttft_ok >= slo.attainment and itl_ok >= slo.attainment, _ep(dep.prefill), _ep(dep.decode),
                     dep.prefill.dp, dep.decode.dp)


def _ep(profile: SimProfile) -> int:
    return profile.ep if profile.num_experts else 0


def pairings(deployment: SimDeployment, explore_tp: bool) -> list[SimDeployment]:
    """``deployment``, or every prefill x decode pair of profiles that hold its KV."""
    if not explore_tp:
        return [deployment]
    p = deployment.prefill
    same = [q for q in load_profiles().values()
            if (q.model, q.dtype_bytes, q.block_size) == (p.model, p.dtype_bytes, p.block_size)]
    if len(same) == 1:
        return [deployment]
    return [pair(f"{a.name}+{b.name}", a, b) for a in same for b in same]


def search(reqs: list[Req], deployment: SimDeployment, slo: Slo, max_nodes: int = 32,
           explore_tp: bool = True, alternatives: int = 4) -> PlanResult:
    if not reqs:
        raise ValueError("plan: the workload has no request")
    span = max(reqs[-1].arrival - reqs[0].arrival, 1e-9)
    rate = len(reqs) / span
    isl = sum(r.isl for r in reqs) / len(reqs)
    osl = sum(r.osl for r in reqs) / len(reqs)
    tried: dict[tuple[str, str, int, int], Candidate] = {}
    for dep in pairings(deployment, explore_tp):
        def ev(p: int, d: int, dep: SimDeployment = dep) -> Candidate:
            key = (dep.prefill.name, dep.decode.name, p, d)
            if key not in tried:
                tried[key] = evaluate(reqs, dep, p, d, slo)
            return tried[key]

        model = PoolModel(dep, slo)  # sizes in simulated nodes: a DP pool's in ranks
        dp_p, dp_d = dep.prefill.dp, dep.decode.dp
        p0 = -(-model.size_prefill(rate, isl, max_nodes * dp_p).nodes // dp_p)
        d0 = -(-model.size_decode(rate, isl, osl, max_nodes * dp_d).nodes // dp_d)
        plenty_p, plenty_d = min(max_nodes, 2 * p0 + 2), min(max_nodes, 2 * d0 + 2)
        start_p = max(1, math.ceil(rate * model.prefill_seconds(isl) * 0.8 / dp_p))
        p_star = next((p for p in range(min(start_p, max_nodes), max_nodes + 1)
                       if ev(p, plenty_d).ttft_ok >= slo.attainment), max_nodes)
        d_star = next((d for d in range(1, max_nodes + 1) if ev(plenty_p, d).itl_ok >= slo.attainment), max_nodes)
        p, d = p_star, d_star
        while True:  # grow the pool that misses until both reach the SLO together
            c = ev(p, d)
            if c.meets or (p >= max_nodes and d >= max_nodes):
                break
            if c.ttft_ok < slo.attainment and p < max_nodes:
                p += 1
            elif d < max_nodes:
                d += 1
            else:
                p += 1
        for dp, dd in ((-1, 0), (0, -1), (1, 0), (0, 1), (-1, 1), (1, -1)):
            if 1 <= p + dp <= max_nodes and 1 <= d + dd <= max_nodes:
                ev(p + dp, d + dd)
    evaluated = sorted(tried.values(), key=lambda c: (c.devices, -c.worst))
    meeting = [c for c in evaluated if c.meets]
    best = meeting[0] if meeting else None
    rest = [c for c in meeting[1:]][:alternatives]
    if len(rest) < alternatives:
        misses = sorted((c for c in evaluated if not c.meets), key=lambda c: (-c.worst, c.devices))
        rest += misses[:alternatives - len(rest)]
    return PlanResult(best, rest, evaluated)
