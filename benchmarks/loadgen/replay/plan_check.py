"""A plan's check: replay its workload on simulated nodes of the chosen fleet and measure
what the model predicted (``splitserve plan --check``, the planner benchmarks).

    fleet      a SimCluster with one sim-nodes process per node (the planner starts and
               drains them one by one too), each role on its own profile, the router's
               weights for the profile (replay/run.py sim_router_args)
    measured   per request, in trace time (wall x speed-up): TTFT, and its mean ITL
               ((E2E - TTFT) / (output tokens - 1)); the share within each SLO bound (a
               failed request is within neither) and the SLO's quantile of each
    sustained  whether this machine kept the simulation's pace, else the figures are
               not the trace's and are reported as such, not as results:
                 - the replay's sends kept to the schedule (replay/run.py schedule_check)
                 - no node's steps overran their simulated time by more than
                   MAX_OVERRUN_SHARE of the run (/debug/state sim_overrun_s)

The speed-up is the trace's pace: above 1 the run is shorter than the trace, below 1
longer, chosen (``pick_speedup``) so that the output tokens streamed and the KV blocks
moved per wall second stay under what this machine's router and nodes carry
(``token_budget``, ``block_budget``): the host's own time per token and per block is
wall time, so it counts speed-up times more in the trace's time.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import NamedTuple

from splitserve.deploy.planner.sim_profiles import SimDeployment
from splitserve.common.trace import TraceRequest
from splitserve.deploy.launcher import SimCluster
from splitserve.deploy.planner.offline.search import quantile
from splitserve.deploy.planner.slo import Slo

from .run import Outcome, node_metrics, node_side, node_states, replay, schedule_check, sim_router_args

MAX_OVERRUN_SHARE = 0.02  # of a node's wall time spent behind its simulated steps
TOKEN_BUDGET = 1500.0  # output tokens per wall second this 2-core machine streams with room to spare
# KV blocks per wall second the simulated transfer path moves with room to spare (each block
# costs the sender and the receiver ~0.1 ms of Python however small the simulated KV is)
BLOCK_BUDGET = 600.0
MODEL = "SmolLM2-135M-Instruct"  # simulated nodes serve the bundled model's name


class Measured(NamedTuple):
    requests: int
    failed: int
    ttft_ok: float
    itl_ok: float
    ttft_q_s: float
    itl_q_s: float
    errors: dict[str, int]  # first 80 characters of an error -> requests


def pick_speedup(trace: list[TraceRequest], token_budget: float = TOKEN_BUDGET, block_budget: float = BLOCK_BUDGET,
                 block_size: int = 16, most: float = 1.0) -> float:
    """The pace at which ``trace``'s output tokens stream at ``token_budget`` per wall
    second at most, and its prompts' KV blocks move at ``block_budget`` (and at most ``most``
    times real time), rounded down to 2 digits."""
    span = max(1e-9, (trace[-1].timestamp - trace[0].timestamp) / 1000)
    tokens_per_s = sum(r.output_length for r in trace) / span
    blocks_per_s = sum(r.input_length for r in trace) / block_size / span
    s = min(most, token_budget / max(tokens_per_s, 1e-9), block_budget / max(blocks_per_s, 1e-9))
    return math.floor(s * 100) / 100 if s >= 0.01 else s


def measure(outcomes: list[Outcome], speedup: float, slo: Slo) -> Measured:
    ttft = [o.ttft_s * speedup if o.ok else math.inf for o in outcomes]
    itl = [(o.itl_s * speedup if o.ok else math.inf) for o in outcomes]  # nan: a one-token answer
    n = max(1, len(outcomes))
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error[:80]] = errors.get(o.error[:80], 0) + 1
    return Measured(len(outcomes), sum(not o.ok for o in outcomes),
                    round(sum(t <= slo.ttft_s for t in ttft) / n, 4),
                    round(sum(math.isnan(x) or x <= slo.itl_s for x in itl) / n, 4),
                    round(quantile(ttft, slo.attainment), 4), round(quantile(itl, slo.attainment), 5), errors)


def sustain_check(outcomes: list[Outcome], overrun_s: dict[str, float], wall_s: float, speedup: float) -> dict:
    """Did this machine keep the simulation's pace? ``overrun_s``: node -> its
    sim_overrun_s (wall) over a run of ``wall_s``."""
    return judge_pace(schedule_check(outcomes, speedup), overrun_s, wall_s)


def judge_pace(schedule: dict, overrun_s: dict[str, float], wall_s: float, transfers: dict | None = None) -> dict:
    """Whether a run kept its pace, and why not: ``schedule`` (replay/run.py
    ``schedule_check``), every node's overrun over ``wall_s``, and where nodes model their
    network, ``transfers`` (``transfer_check``)."""
    worst = max(overrun_s.items(), key=lambda kv: kv[1], default=("", 0.0))
    share = worst[1] / max(wall_s, 1e-9)
    why = []
    if schedule["behind_schedule"]:
        why.append(f"the replay sent p99 {schedule['late_p99_s']:.3f} s (wall) behind its schedule")
    if share > MAX_OVERRUN_SHARE:
        why.append(f"node {worst[0]} ran {share:.1%} of the run behind its simulated steps")
    if transfers is not None and transfers["behind_model"]:
        why.append(f"transfers moved {transfers['late_share_of_ttft']:.1%} of the TTFT behind the modelled network")
    return {"sustained": not why, "why": why, **schedule, "worst_node_overrun_share": round(share, 4),
            "overrun_s": {k: round(v, 3) for k, v in sorted(overrun_s.items())}}


def start_fleet(deployment: SimDeployment, prefill_nodes: int, decode_nodes: int, speedup: float,
                router_args=(), timeout: float = 240.0) -> SimCluster:
    """Redis, a router and the nodes, one process each, standing for ``deployment``."""
    cluster = SimCluster(prefill_nodes, decode_nodes, sim_args=["--sim-speedup", str(speedup), "--drain-grace", "600"],
                         router_args=(*sim_router_args(deployment.prefill.name, speedup), *router_args), per_node=True,
                         role_profiles={"prefill": deployment.prefill.name, "decode": deployment.decode.name})
    try:
        return cluster.start(timeout)
    except BaseException:
        cluster.stop()
        raise


async def overruns(redis_url: str) -> dict[str, float]:
    """node id -> sim_overrun_s of every registered node."""
    return {nid: float(st.get("sim_overrun_s", 0.0)) for nid, st in (await node_states(redis_url)).items()}


def check_plan(trace: list[TraceRequest], deployment: SimDeployment, prefill_nodes: int, decode_nodes: int,
               slo: Slo, speedup: float) -> dict:
    """Replay ``trace`` on the fleet; measured figures and whether they are the trace's."""
    cluster = start_fleet(deployment, prefill_nodes, decode_nodes, speedup)
    try:
        start = time.perf_counter()
        outcomes = asyncio.run(replay(trace, cluster.url, MODEL, speedup, 1 << 30))
        wall = time.perf_counter() - start
        over = asyncio.run(overruns(cluster.redis_url))
        prefill = node_side({"prefill": asyncio.run(node_metrics(cluster.redis_url, "prefill"))}, speedup)["prefill"]
    finally:
        cluster.stop()
    m = measure(outcomes, speedup, slo)
    ok = [o.ttft_s for o in outcomes if o.ok]
    ttft_mean = sum(ok) / len(ok) * speedup if ok else math.nan
    at_nodes = prefill["queue_s"] + prefill["prefill_s"]
    return {"measured": m._asdict(), "speedup": speedup, "wall_s": round(wall, 1),
            # where the TTFT went, trace seconds: the prefill nodes' queue and compute (what the model
            # predicts) and the rest of the path (router, reservation, KV transfer, the first token's hop)
            "ttft_mean_s": round(ttft_mean, 4), "ttft_at_prefill_nodes_s": round(at_nodes, 4),
            "ttft_path_s": round(ttft_mean - at_nodes, 4),
            "sustain": sustain_check(outcomes, over, wall, speedup)}


def judge_replay(r: dict, more: list[str] | None = None) -> dict:
    """``judge_pace`` of a ``run_replay`` result, also refusing failed requests and the
    caller's ``more`` reasons: {..., "sustained", "why"}."""
    pace = judge_pace(r["schedule"], r["sim_overrun_s"], r["wall_s"], r["transfers"])
    why = pace["why"] + ([f"{r['failed']} requests failed"] if r["failed"] else []) + (more or [])
    return {**pace, "sustained": not why, "why": why}
