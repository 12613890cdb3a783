"""Does ``splitserve plan`` pick different P:D ratios for prompt-heavy, output-heavy and
mixed work on the llama3-8b-h100 profile, and does each chosen fleet, replayed on
simulated nodes, meet the SLO the plan predicted?

    .venv/bin/python benchmarks/planner/bench_plan.py                 # ~35 min here

For each workload of ``deploy/planner/offline/workload.py`` PRESETS (two minutes of
Poisson arrivals each, no shared prefix): the plan (the fleet model's search,
deploy/planner/offline/search.py) for TTFT p90 <= 1 s and ITL p90 <= 15 ms, then the
trace replayed on the chosen fleet (``plan --check``: one sim-nodes process per node,
standing for an H100 each, the real router, Redis and KV transport). The replay runs
slower than real time where it must: an H100 decode node streams ~10k tokens/s and its
prompts move ~2k KV blocks/s, far more than this 2-core machine's router and nodes carry
in real time, so each run's pace keeps the output tokens under 1500 and the blocks under
600 per wall second (plan_check.py ``pick_speedup``); the host's own time then weighs
little in the trace's time. Each run is checked for keeping its pace (sends on
schedule, no node overrunning its steps); one that does not is reported as not
sustained, not as a result.

Reported per workload: the chosen P:D, predicted and measured attainment of each bound and
the SLO's quantile of TTFT and ITL, and the error (measured - predicted). Targets: three
different P:D ratios; each measured attainment at least the SLO's 90% and within
``--max-error`` (5 points) of the prediction. Writes ``benchmarks/results/plan_llama3_8b.json``
and ``plan_llama3_8b.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from splitserve.benchmarks.harness import RESULTS
from splitserve.benchmarks.loadgen.replay.plan_check import check_plan, pick_speedup
from splitserve.deploy.planner.sim_profiles import get_deployment
from splitserve.common.trace import summarize
from splitserve.deploy.planner.offline.search import search
from splitserve.deploy.planner.offline.workload import PRESETS, as_reqs, generate
from splitserve.deploy.planner.slo import Slo

WORKLOADS = ("prompt-heavy", "mixed", "output-heavy")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["workloads"]
    names = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    x = range(len(names))
    for ax, key, unit, scale, bound in ((axes[0], "ttft_q_s", "s", 1, result["slo"]["ttft_s"]),
                                        (axes[1], "itl_q_s", "ms", 1000, result["slo"]["itl_s"] * 1000)):
        ax.bar([i - 0.2 for i in x], [rows[n]["predicted"][key] * scale for n in names], 0.4, label="predicted")
        ax.bar([i + 0.2 for i in x], [rows[n]["measured"][key] * scale for n in names], 0.4, label="measured")
        ax.axhline(bound, color="gray", linestyle="--", label="SLO")
        ax.set_xticks(list(x), [f"{n}\n{rows[n]['fleet']}" for n in names], fontsize=8)
        ax.set_ylabel(f"{key.split('_')[0].upper()} p{result['slo']['attainment'] * 100:g} ({unit})")
        ax.legend(fontsize=8)
    for i, n in enumerate(names):
        for j, (key, marker) in enumerate((("ttft_ok", "o"), ("itl_ok", "s"))):
            axes[2].scatter([i + (j - 0.5) * 0.2], [rows[n]["predicted"][key] * 100], marker=marker, color="tab:blue",
                            label="predicted" if i == 0 and j == 0 else None)
            axes[2].scatter([i + (j - 0.5) * 0.2], [rows[n]["measured"][key] * 100], marker=marker,
                            color="tab:orange", label="measured" if i == 0 and j == 0 else None)
    axes[2].axhline(result["slo"]["attainment"] * 100, color="gray", linestyle="--")
    axes[2].set_xticks(list(x), names, fontsize=8)
    axes[2].set_ylabel("% within the SLO (o TTFT, s ITL)")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"splitserve plan on {result['profile']}: predicted vs replayed ({result['slo_text']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--ttft", type=float, default=1000.0, help="ms, p90")
    ap.add_argument("--itl", type=float, default=15.0, help="ms, p90")
    ap.add_argument("--duration", type=float, default=None, help="trace seconds (default: the preset's, 120)")
    ap.add_argument("--max-error", type=float, default=0.05, help="allowed |measured - predicted| attainment")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "plan_llama3_8b.json"))
    args = ap.parse_args()

    dep = get_deployment(args.profile)
    slo = Slo(args.ttft / 1000, args.itl / 1000, 0.9)
    rows: dict[str, dict] = {}
    for name in args.workloads:
        phases = PRESETS[name]
        if args.duration:
            phases = tuple(dataclasses.replace(p, duration_s=args.duration) for p in phases)
        trace = generate(phases, seed=args.seed, context=dep.context)
        plan = search(as_reqs(trace), dep, slo, explore_tp=False)
        best = plan.best
        if best is None:
            rows[name] = {"fleet": None, "error": "no fleet tried meets the SLO"}
            continue
        speedup = pick_speedup(trace)
        print(f"[plan] {name}: {best.label()} ({best.devices} H100s); replaying at {speedup}x ...",
              file=sys.stderr, flush=True)
        check = check_plan(trace, dep, best.prefill_nodes, best.decode_nodes, slo, speedup)
        m = check["measured"]
        predicted = {k: getattr(best, k) for k in ("ttft_ok", "itl_ok", "ttft_q_s", "itl_q_s")}
        err = {k: round(m[k] - predicted[k], 4) for k in predicted}
        rel = {k: round(m[k] / predicted[k] - 1, 3) if predicted[k] else None for k in ("ttft_q_s", "itl_q_s")}
        ok = (m["failed"] == 0 and min(m["ttft_ok"], m["itl_ok"]) >= slo.attainment
              and max(abs(err["ttft_ok"]), abs(err["itl_ok"])) <= args.max_error)
        rows[name] = {"fleet": f"{best.prefill_nodes}P:{best.decode_nodes}D", "ratio_p_per_d":
                      round(best.prefill_nodes / best.decode_nodes, 3), "devices": best.devices,
                      "trace": summarize(trace), "predicted": predicted, "measured": m, "error": err,
                      "relative_error": rel, "alternatives": [c._asdict() for c in plan.alternatives],
                      "speedup": speedup, "wall_s": check["wall_s"], "sustain": check["sustain"],
                      "meets_within_error": ok and check["sustain"]["sustained"]}
        print(f"[plan] {name}: TTFT within SLO {m['ttft_ok']:.1%} (predicted {best.ttft_ok:.1%}), ITL "
              f"{m['itl_ok']:.1%} (predicted {best.itl_ok:.1%}); p90 TTFT {m['ttft_q_s']:.3f} s (predicted "
              f"{best.ttft_q_s:.3f}), ITL {m['itl_q_s'] * 1000:.1f} ms (predicted {best.itl_q_s * 1000:.1f}); "
              f"sustained {check['sustain']['sustained']}", file=sys.stderr, flush=True)
    ratios = [r["ratio_p_per_d"] for r in rows.values() if r.get("fleet")]
    result = {"question": "does plan pick different P:D ratios per workload, and does each chosen fleet meet the "
                          "predicted SLO when replayed?",
              "profile": args.profile, "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s, "attainment": slo.attainment},
              "slo_text": slo.describe(), "max_error": args.max_error, "workloads": rows,
              "verdict": {"distinct_ratios": len(set(ratios)) == len(ratios) == len(args.workloads),
                          "all_meet_within_error": all(r.get("meets_within_error") for r in rows.values()),
                          "all_sustained": all(r.get("sustain", {}).get("sustained") for r in rows.values())}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if all(r.get("fleet") for r in rows.values()):
        plot(result, out.with_suffix(".png"))
    print(json.dumps(result["verdict"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
