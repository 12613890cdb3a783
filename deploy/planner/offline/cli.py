"""``splitserve plan``: flags -> a workload (a trace, a named preset or phases) and an
SLO -> the search (search.py) -> the table, ``--result-json`` and its plot (report.py);
``--write-trace`` keeps the generated workload for ``splitserve replay``.

``--check`` replays the workload on simulated nodes: a load tool a layer above
(benchmarks/loadgen/replay/plan_check.py), which the top-level CLI hands in as a
``PlanCheck``.

Exit status 0 when a configuration meets the SLO, 1 when none tried does, 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NamedTuple

from ..sim_profiles import SimDeployment, get_deployment, get_profile, pair
from ....common.trace import HASH_BLOCK, TraceRequest, dump_trace, load_trace, summarize
from ..slo import Slo, add_slo_args, slo_from_args
from .report import format_plan, write
from .search import search
from .workload import PRESETS, as_reqs, generate, parse_phase


class PlanCheck(NamedTuple):
    """What ``--check`` runs (benchmarks/loadgen/replay/plan_check.py)."""

    pick_speedup: Callable[[list[TraceRequest]], float]  # trace -> the pace this machine keeps
    # trace, fleet, prefill nodes, decode nodes, SLO, speed-up -> what the simulated nodes measured
    check_plan: Callable[[list[TraceRequest], SimDeployment, int, int, Slo, float], dict]


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="llama3-8b-h100",
                   help="a profile or deployment (splitserve sim-nodes --list-profiles)")
    w = p.add_argument_group("workload (one of)")
    w.add_argument("--trace", default=None, help="a routing trace (JSONL, splitserve make-trace)")
    w.add_argument("--workload", choices=sorted(PRESETS), default=None,
                   help="a named workload: " + "; ".join(
                       f"{k}: " + ", ".join(f"{ph.rate:g}/s {ph.input_mean} in {ph.output_mean} out" for ph in v)
                       for k, v in PRESETS.items()))
    w.add_argument("--phase", action="append", default=None, metavar="DURATION:RATE:IN:OUT[:SIGMA]",
                   help="a phase of Poisson arrivals with lognormal lengths (repeatable: one after the other)")
    w.add_argument("--rate-scale", type=float, default=1.0, help="multiply the workload's rates")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--trace-block-size", type=int, default=HASH_BLOCK, help="tokens per hash id of --trace")
    add_slo_args(p)
    s = p.add_argument_group("search")
    s.add_argument("--max-nodes", type=int, default=32, help="per pool")
    s.add_argument("--no-explore-tp", action="store_true",
                   help="only the profile as named (default: every TP or EP profile of its model, per pool)")
    s.add_argument("--alternatives", type=int, default=4)
    p.add_argument("--result-json", default=None, help="also writes the cost/attainment plot beside it (.png)")
    p.add_argument("--write-trace", default=None, help="write the generated workload as a trace")
    p.add_argument("--check", action="store_true",
                   help="then replay the workload on simulated nodes of the chosen fleet and print what they "
                        "measured beside the prediction (minutes; plan_check.py)")
    p.add_argument("--check-speedup", type=float, default=None,
                   help="the check's pace (default: as fast as keeps this machine's token rate under budget, "
                        "at most real time)")


def main(args: argparse.Namespace, check: PlanCheck) -> int:
    slo = slo_from_args(args)
    dep = get_deployment(args.profile)
    given = sum(x is not None for x in (args.trace, args.workload, args.phase))
    if given != 1:
        raise ValueError("plan: give one workload: --trace FILE, --workload NAME or --phase ... (repeatable)")
    if args.trace:
        trace = load_trace(args.trace, args.trace_block_size)
    else:
        phases = PRESETS[args.workload] if args.workload else tuple(parse_phase(x) for x in args.phase)
        trace = generate(phases, args.seed, dep.context, args.rate_scale)
    if not trace:
        raise ValueError("plan: the workload has no request (raise the rate or the duration)")
    if args.write_trace:
        dump_trace(trace, args.write_trace)
    result = search(as_reqs(trace), dep, slo, args.max_nodes, not args.no_explore_tp, args.alternatives)
    summary = {"profile": args.profile, "workload": args.trace or args.workload or args.phase,
               "trace": summarize(trace)}
    print(format_plan(result, slo, summary["trace"]))
    if result.best is None:
        if args.result_json:
            write(result, slo, summary, args.result_json)
        print("error: no configuration tried meets the SLO", file=sys.stderr)
        return 1
    if args.check:
        b = result.best
        fleet = pair(b.label(), get_profile(b.prefill_profile), get_profile(b.decode_profile))
        speedup = args.check_speedup or check.pick_speedup(trace)
        print(f"checking {b.label()} on simulated nodes at {speedup}x ...", file=sys.stderr, flush=True)
        # a DP node is dp simulated ranks
        summary["check"] = checked = check.check_plan(trace, fleet, b.prefill_nodes * b.prefill_dp,
                                                      b.decode_nodes * b.decode_dp, slo, speedup)
        m, sustain = checked["measured"], checked["sustain"]
        print(f"check: TTFT within SLO {m['ttft_ok']:.1%} (predicted {b.ttft_ok:.1%}), ITL {m['itl_ok']:.1%} "
              f"(predicted {b.itl_ok:.1%}); {m['failed']} failed"
              + ("" if sustain["sustained"] else "; NOT SUSTAINED: " + "; ".join(sustain["why"])))
    if args.result_json:
        write(result, slo, summary, args.result_json)
    return 0
