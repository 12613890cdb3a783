"""Does cache-aware routing beat least_load and round_robin at scale, and how close does
it come to the oracle's prefix hits? Generated multi-tenant traces replayed against 16
and 64 simulated prefill nodes through the real router and a real Redis (``splitserve
replay``, one run each).

    .venv/bin/python benchmarks/router/bench_routing.py [--nodes 16 64] [--speedup 10 8] [--duration 1800]
    .venv/bin/python benchmarks/router/bench_routing.py --preset long-context --profile llama3-8b-h100 \
        --rate-per-16 1.0 --duration 300 --out routing_long_context

``--preset`` picks the trace generator's preset (``make-trace --preset``),
``--profile`` the GPU deployment the simulated nodes stand for (their context,
KV pool and roofline timing; ``--kv-cache-memory`` is then ignored): a profile, or a
deployment of a prefill and a decode profile (the greedy balancer then times the
prefill profile)::

    .venv/bin/python benchmarks/router/bench_routing.py --preset long-context \
        --profile llama3-70b-p-tp4-d-tp8-h100 --nodes 8 --rate-per-16 1.0 --duration 120 --speedup 5 \
        --max-output-tokens 4 --out routing_70b_tp4_tp8      # ~8 minutes here

Each size gets its own trace (``make-trace`` defaults, conversations starting at
``0.25 / s per 16 prefill nodes`` for ``--duration`` seconds, so the load per node
is the same) and a quarter as many decode nodes. Conversations stick to the node
that holds them, so a short trace (few conversations per node) leaves the busy
time per node as uneven as the conversations are long: about 27 per node here.
With ``--profile`` the results also give ``greedy_max_mean_load``, the max/mean load
of an online balancer that knows every node's exact busy time
(benchmarks/loadgen/replay/balance.py): how evenly this trace's work can be spread at
all when single requests are long. Targets: cache_aware's hit rate >= 90% of the
oracle's, its TTFT p50 >= 2x better than round_robin's, max/mean load <= 1.3.
Writes ``benchmarks/results/routing.json`` and ``routing.png``.
"""

import argparse
import json
import sys
from pathlib import Path

from splitserve.benchmarks.harness import RESULTS
from splitserve.benchmarks.loadgen.replay.balance import greedy_max_mean
from splitserve.benchmarks.loadgen.replay.generate import generate
from splitserve.benchmarks.loadgen.replay.run import ReplayConfig, print_summary, run_replay
from splitserve.deploy.planner.sim_profiles import get_deployment
from splitserve.common.trace import dump_trace, summarize
from splitserve.router.routing.policy_registry import BUILTIN

POLICIES = tuple(spec.name for spec in BUILTIN)  # the built-in policies, compared
RATE_PER_16_NODES = 0.25  # new conversations per second of trace time


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.2
    for k, policy in enumerate(POLICIES):
        xs = [i + (k - 1) * width for i in range(len(sizes))]
        runs = [results[s]["runs"][policy] for s in sizes]
        axes[0].bar(xs, [r["hit_rate"] for r in runs], width, label=policy)
        axes[1].bar(xs, [r["ttft_p50"] for r in runs], width, label=f"{policy} p50")
        axes[1].scatter(xs, [r["ttft_p99"] for r in runs], marker="_", s=200, color="k")
        axes[2].bar(xs, [r["max_mean_load"] for r in runs], width, label=policy)
    oracle_x = [i + 2 * width for i in range(len(sizes))]
    axes[0].bar(oracle_x, [results[s]["oracle_hit_rate"] for s in sizes], width, label="oracle", color="grey")
    axes[0].set_title("prefix hit rate")
    axes[1].set_title("TTFT p50 (bars), p99 (ticks), s of trace time")
    axes[1].set_yscale("log")
    axes[2].set_title("max / mean prefill-node busy time")
    axes[2].axhline(1.3, ls="--", color="r", lw=1)
    greedy = [results[s].get("greedy_max_mean_load") for s in sizes]
    if all(g is not None for g in greedy):
        axes[2].bar(oracle_x, greedy, width, label="greedy balancer", color="grey")
        axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(range(len(sizes)), [f"{s} prefill nodes" for s in sizes])
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--duration", type=float, default=1800.0, help="trace seconds in which conversations start")
    ap.add_argument("--speedup", type=float, nargs="+", default=[10.0, 8.0],
                    help="per size: trace seconds per wall second (the 64-node run needs more wall time)")
    ap.add_argument("--kv-cache-memory", default="4GiB", help="per simulated node")
    ap.add_argument("--fleet-procs", type=int, default=2)
    ap.add_argument("--preset", default="default", help="trace preset (make-trace --preset)")
    ap.add_argument("--profile", default=None,
                    help="simulated-node profile or deployment (sim-nodes --list-profiles)")
    ap.add_argument("--rate-per-16", type=float, default=RATE_PER_16_NODES,
                    help="new conversations per second of trace time per 16 prefill nodes")
    ap.add_argument("--max-output-tokens", type=int, default=16)
    ap.add_argument("--out", default="routing", help="results/<out>.json and .png")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--router-arg", action="append", default=[],
                    help="extra router argument, repeatable (e.g. --router-arg=--score-weights=balance=4)")
    ap.add_argument("--combine", nargs="+", metavar="JSON", default=None,
                    help="no runs: merge the policies' runs of these results files (same trace, "
                         "e.g. cache_aware and least_load/round_robin run apart) into --out, with "
                         "the targets and the plot")
    args = ap.parse_args()
    if args.combine:
        return combine([Path(p) for p in args.combine], args.out)
    import dataclasses
    from splitserve.benchmarks.loadgen.replay.generate import PRESETS
    RESULTS.mkdir(exist_ok=True)
    results = {}
    for size, speedup in zip(args.nodes, args.speedup + args.speedup[-1:] * len(args.nodes)):
        trace = generate(dataclasses.replace(PRESETS[args.preset], rate=args.rate_per_16 * size / 16,
                                             duration_s=args.duration))
        path = RESULTS / f"routing_trace_{size}.jsonl"
        dump_trace(trace, path)
        info = summarize(trace)
        greedy = greedy_max_mean(trace, size, get_deployment(args.profile).prefill) if args.profile else None
        print(f"== {size} prefill nodes: trace {info}, greedy balancer's max/mean load {greedy}",
              file=sys.stderr, flush=True)
        runs = {}
        for policy in args.policies:
            r = run_replay(ReplayConfig(trace=str(path), prefill_nodes=size, policy=policy, speedup=speedup,
                                        kv_cache_memory=args.kv_cache_memory, fleet_procs=args.fleet_procs,
                                        profile=args.profile, max_output_tokens=args.max_output_tokens,
                                        router_args=tuple(args.router_arg)))
            print_summary(r)
            runs[policy] = {k: v for k, v in r.items() if k != "per_request"}
        results[size] = {
            "oracle_hit_rate": info["oracle_hit_rate"], "trace": info, "speedup": speedup, "runs": runs,
            "greedy_max_mean_load": greedy,
            "preset": args.preset, "profile": args.profile, "rate_per_16": args.rate_per_16,
            "router_args": args.router_arg,
        }
        add_targets(results[size])
        path.unlink()  # regenerated from the spec; not worth keeping in the repository
    return report(results, args.out)


def add_targets(res: dict) -> None:
    runs = res["runs"]
    if set(runs) == set(POLICIES):
        ca, rr, ll = runs["cache_aware"], runs["round_robin"], runs["least_load"]
        res["targets"] = {
            "hit_rate_vs_oracle": ca["hit_rate_vs_oracle"],
            "ttft_p50_rr_over_ca": round(rr["ttft_p50"] / ca["ttft_p50"], 2),
            "ttft_p99_ca_over_ll": round(ca["ttft_p99"] / ll["ttft_p99"], 2),
            "failed": sum(r["failed"] for r in runs.values()), "max_mean_load": ca["max_mean_load"],
            "greedy_max_mean_load": res.get("greedy_max_mean_load")}


def combine(paths: list[Path], out: str) -> int:
    """One results file from several of the same trace: each size's runs merged (a
    later file's run of a policy replaces an earlier one's)."""
    results: dict = {}
    for p in paths:
        for size, res in json.loads(p.read_text()).items():
            if size in results and results[size]["trace"] != res["trace"]:
                raise SystemExit(f"--combine: {p} replayed another trace at {size} nodes")
            merged = results.setdefault(size, {**res, "runs": {}, "combined_from": []})
            merged["runs"].update(res["runs"])
            merged["combined_from"].append(p.name)
    for res in results.values():
        add_targets(res)
    return report({int(k): v for k, v in results.items()}, out)


def report(results: dict, out: str) -> int:
    (RESULTS / f"{out}.json").write_text(json.dumps(results, indent=1))
    plotted = all(set(r["runs"]) == set(POLICIES) for r in results.values())
    if plotted:  # the plot compares the policies
        plot(results, RESULTS / f"{out}.png")
    print(f"\n{'nodes':>6s} {'policy':>12s} {'hit':>7s} {'oracle':>7s} {'p50 s':>8s} {'p99 s':>8s} "
          f"{'load':>6s} {'reqs':>6s} {'failed':>6s}")
    for size, res in results.items():
        for policy, r in res["runs"].items():
            print(f"{size:6d} {policy:>12s} {r['hit_rate']:7.1%} {r['oracle_hit_rate']:7.1%} "
                  f"{r['ttft_p50']:8.2f} {r['ttft_p99']:8.2f} {r['max_mean_load']:6.2f} "
                  f"{r['max_mean_requests']:6.2f} {r['failed']:6d}")
        t = res.get("targets")
        if t is None:
            continue
        print(f"{size:6d} targets: hit/oracle {t['hit_rate_vs_oracle']:.3f} (>= 0.9), RR/CA TTFT p50 "
              f"{t['ttft_p50_rr_over_ca']:.2f} (>= 2), CA/LL TTFT p99 {t['ttft_p99_ca_over_ll']:.2f} (<= 1), "
              f"max/mean load {t['max_mean_load']:.2f} (<= 1.3; the greedy balancer's "
              f"{t['greedy_max_mean_load']}), failed {t['failed']} (0)")
    print(f"wrote {RESULTS / (out + '.json')}" + (f" and {out}.png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
