"""Do a host-memory tier of the prefix cache keep capacity-bound long-context traffic
cached, and does the time to first token show it? 16 simulated ``llama3-8b-h100`` prefill
nodes (and 4 decode nodes) replay the ``prefix-groups`` trace (``make-trace --preset
prefix-groups``: ~15k-token prompts in groups of 2-24 sharing 97%, reused a minute or a
return after a break apart, a working set ~3x the 16 nodes' KV pools) through the real
router, Redis and KV transport (``splitserve replay``), three times in one run:

    none       no tier below the KV pool
    host       a host-memory tier of the profile's size on every node (4 KV pools)
    unlimited  a host tier of UNLIMITED_POOLS KV pools: no block leaves it (the host tier's
               evictions are reported: 0), the prefix cache a fleet could at best hold

    .venv/bin/python benchmarks/router/bench_tiers.py [--seed 0] [--speedup 1.0] [--out tiers]

The nodes price what matters here as the deployment would: a prompt's compute (the
roofline), a tier's loads and stores at PCIe Gen5 rate (engine/sim_runner.py), and the KV
transfer to the decode node at one 400 Gb/s NIC per GPU (node/sim_link.py). Each run is
checked for keeping its pace (sends on schedule; no node's steps behind their simulated time
more than replay/plan_check.py's MAX_OVERRUN_SHARE of the run; transfers moved within their modelled
time: replay/run.py ``transfer_check``; judged by replay/plan_check.py ``judge_pace``); a run that
did not is reported as not sustained and its ratios are not claimed.

Reported per variant: the prefix hit rate (prompt tokens cached over prompt tokens) and by
tier, the oracle's, TTFT p50/p90/p99 in trace seconds, the TTFT of misses (under 10% of the
prompt cached), partial hits and hits (90% or more) apart, TPOT p50/p99 (each request's time
per output token after the first, from the streamed tokens: the decode nodes' pace), the
prompt tokens by source (decode-side reuse, prefill-node hits, pulled, computed), failed
requests and the sustain checks. Targets: hit rate (host) / hit rate (unlimited) >= 0.9,
TTFT p50 (none) / TTFT p50 (host) >= 1.5. Writes ``benchmarks/results/<out>.json`` and
``<out>.png``.

``--trace long-context`` (issue 53) replays the ``long-context`` preset instead
(``make-trace --preset long-context``: multi-turn conversations over shared documents and
tool results, prompts of p50 ~10k, p90 ~33k tokens), none against host: a host tier must not
cost the decode nodes their pace while it keeps its hits, whatever of a conversation a
decode node holds below its device (its loads run beside its decodes, within what a step
hides; the router prices them before choosing decode-side reuse). Targets: TPOT p99 (host) /
TPOT p99 (none) <= 1.10 and hit rate (host) >= hit rate (none):

    .venv/bin/python benchmarks/router/bench_tiers.py --trace long-context --variants none host --out tiers_long_context
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from splitserve.benchmarks.harness import RESULTS
from splitserve.benchmarks.loadgen.replay.generate import PRESETS, TraceSpec, generate
from splitserve.benchmarks.loadgen.replay.groups import GroupSpec, generate_groups, group_stats
from splitserve.benchmarks.loadgen.replay.plan_check import judge_pace
from splitserve.benchmarks.loadgen.replay.run import ReplayConfig, percentile, print_summary, run_replay
from splitserve.deploy.planner.sim_profiles import get_profile
from splitserve.common.trace import dump_trace
from splitserve.common.trace import summarize as trace_summary

VARIANTS = ("none", "host", "unlimited")
UNLIMITED_POOLS = 16  # host tier of the unlimited variant, in KV pools per node (the trace's is ~3 per node)
TARGET_HIT_RATIO = 0.9  # hit rate (host) / hit rate (unlimited)
TARGET_TTFT_RATIO = 1.5  # TTFT p50 (none) / TTFT p50 (host)
TARGET_TPOT_RATIO = 1.10  # long-context: TPOT p99 (host) / TPOT p99 (none), at most
TRACES = ("prefix-groups", "long-context")


def host_tier_bytes(variant: str, profile_name: str) -> int | None:
    p = get_profile(profile_name)
    return {"none": None, "host": p.host_tier_bytes, "unlimited": UNLIMITED_POOLS * p.kv_pool_bytes}[variant]


def ttft_by_hit(per_request: list) -> dict:
    """TTFT p50/p90 (trace seconds) and count of the answered requests with under 10% of the
    prompt cached (miss), 90% or more (hit), and between (partial)."""
    classes: dict[str, list[float]] = {"miss": [], "partial": [], "hit": []}
    for ttft, prompt, cached in per_request:
        if ttft is not None:
            share = cached / prompt
            classes["miss" if share < 0.1 else "hit" if share >= 0.9 else "partial"].append(ttft)
    return {name: {"requests": len(v), "ttft_p50": round(percentile(v, 0.5), 3), "ttft_p90": round(percentile(v, 0.9), 3)}
            for name, v in classes.items() if v}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = [v for v in VARIANTS if v in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    bottom = [0.0] * len(names)
    for tier, color in (("device", "tab:blue"), ("host", "tab:orange"), ("disk", "tab:green")):
        shares = [(runs[n]["hit_rate_by_tier"] or {"device": runs[n]["hit_rate"]}).get(tier, 0.0) for n in names]
        axes[0].bar(names, shares, bottom=bottom, color=color, label=tier)
        bottom = [b + s for b, s in zip(bottom, shares)]
    if "unlimited_hit_rate" in result["trace"]:  # prefix-groups' own statistics
        axes[0].axhline(result["trace"]["unlimited_hit_rate"], ls="--", color="gray", label="oracle (unlimited)")
        axes[0].axhline(result["trace"]["capacity_lru_hit_rate"], ls=":", color="gray", label="LRU of the fleet's KV")
    axes[0].set_title("prompt tokens served from the prefix cache, by tier")
    axes[0].legend(fontsize=8)
    xs = range(len(names))
    axes[1].bar([x - 0.2 for x in xs], [runs[n]["ttft_p50"] for n in names], 0.4, label="p50")
    axes[1].bar([x + 0.2 for x in xs], [runs[n]["ttft_p99"] for n in names], 0.4, label="p99")
    axes[1].set_xticks(list(xs), names)
    axes[1].set_yscale("log")
    axes[1].set_title("TTFT, seconds of trace time")
    axes[1].legend(fontsize=8)
    axes[2].bar([x - 0.2 for x in xs], [runs[n]["tpot_p50"] * 1e3 for n in names], 0.4, label="p50")
    axes[2].bar([x + 0.2 for x in xs], [runs[n]["tpot_p99"] * 1e3 for n in names], 0.4, label="p99")
    axes[2].set_xticks(list(xs), names)
    axes[2].set_title("TPOT (the decode nodes' pace), ms of trace time")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"{result['nodes']} x {result['profile']}, {result['trace_preset']} trace (seed {result['seed']}), "
                 f"speed-up {result['speedup']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--nodes", type=int, default=16, help="prefill nodes (a quarter as many decode nodes)")
    ap.add_argument("--trace", default="prefix-groups", choices=TRACES, help="the preset replayed (module docstring)")
    ap.add_argument("--seed", type=int, default=0, help="of the trace")
    ap.add_argument("--speedup", type=float, default=1.0, help="trace seconds per wall second")
    ap.add_argument("--max-output-tokens", type=int, default=None,
                    help="cap on each answer (default: 4 for prefix-groups, the TTFT's trace; 512 for "
                         "long-context, whose answers, ~300 tokens, make the decode nodes' TPOT)")
    ap.add_argument("--fleet-procs", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None, help="replay the first N requests only (a smoke run)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", default="tiers", help="results/<out>.json and .png")
    args = ap.parse_args()
    profile = get_profile(args.profile)
    if args.max_output_tokens is None:
        args.max_output_tokens = 4 if args.trace == "prefix-groups" else 512
    RESULTS.mkdir(exist_ok=True)
    if args.trace == "prefix-groups":
        trace = generate_groups(GroupSpec(seed=args.seed))
        stats = group_stats(trace, args.nodes * profile.kv_pool_tokens)
    else:
        spec = PRESETS[args.trace]
        assert isinstance(spec, TraceSpec)
        trace = generate(dataclasses.replace(spec, seed=args.seed))
        stats = {"preset": args.trace, **trace_summary(trace)}
    path = RESULTS / f"{args.out}_trace.jsonl"
    out = RESULTS / f"{args.out}.json"
    dump_trace(trace, path)
    print(f"== trace: {stats}", file=sys.stderr, flush=True)
    runs = {}
    try:
        for variant in args.variants:
            host = host_tier_bytes(variant, args.profile)
            print(f"== {variant}: host tier {host and round(host / 2**30)} GiB per node", file=sys.stderr, flush=True)
            r = run_replay(ReplayConfig(trace=str(path), prefill_nodes=args.nodes, profile=args.profile,
                                        speedup=args.speedup, max_output_tokens=args.max_output_tokens,
                                        fleet_procs=args.fleet_procs, limit=args.limit,
                                        kv_offload_memory=str(host) if host else None))
            print_summary(r)
            pace = judge_pace(r["schedule"], r["sim_overrun_s"], r["wall_s"], r["transfers"])
            runs[variant] = {**{k: v for k, v in r.items() if k != "per_request"},
                             "ttft_by_hit": ttft_by_hit(r["per_request"]), "sustain": pace}
            result = {"profile": args.profile, "trace_preset": args.trace, "nodes": args.nodes, "seed": args.seed,
                      "speedup": args.speedup,
                      "limit": args.limit, "unlimited_pools": UNLIMITED_POOLS, "trace": stats, "runs": runs,
                      "targets": targets(runs)}
            out.write_text(json.dumps(result, indent=1))  # after each variant: a late crash keeps what ran
    finally:
        path.unlink()  # regenerated from the seed; not worth keeping in the repository
    plot(result, RESULTS / f"{args.out}.png")
    report(result)
    print(f"wrote {out} and {args.out}.png")
    return 0


def targets(runs: dict) -> dict:
    """The two ratios, and whether every run they rest on kept its pace."""
    out: dict = {"sustained": all(r["sustain"]["sustained"] for r in runs.values())}
    if {"host", "unlimited"} <= set(runs):
        out["hit_rate_host_over_unlimited"] = ratio(runs["host"]["hit_rate"], runs["unlimited"]["hit_rate"], 3)
    if {"none", "host"} <= set(runs):
        out["ttft_p50_none_over_host"] = ratio(runs["none"]["ttft_p50"], runs["host"]["ttft_p50"], 2)
        out["tpot_p99_host_over_none"] = ratio(runs["host"]["tpot_p99"], runs["none"]["tpot_p99"], 3)
        out["hit_rate_host_over_none"] = ratio(runs["host"]["hit_rate"], runs["none"]["hit_rate"], 3)
    return out


def ratio(a: float, b: float, digits: int) -> float | None:
    """a / b, or None where b is 0 (a run with no hits: a smoke run's first requests)."""
    return round(a / b, digits) if b else None


def report(result: dict) -> None:
    print(f"\n{'variant':>10s} {'hit':>7s} {'device':>7s} {'host':>7s} {'evicted':>9s} {'p50 s':>7s} {'p90 s':>7s} "
          f"{'p99 s':>7s} {'failed':>6s}  sustained")
    for name, r in result["runs"].items():
        tiers = r["hit_rate_by_tier"] or {"device": r["hit_rate"]}
        evicted = (r["lower_tier_blocks"] or {}).get("evictions", {}).get("host")
        print(f"{name:>10s} {r['hit_rate']:7.1%} {tiers.get('device', 0):7.1%} {tiers.get('host', 0):7.1%} "
              f"{'-' if evicted is None else int(evicted):>9} "
              f"{r['ttft_p50']:7.3f} {r['ttft_p90']:7.3f} {r['ttft_p99']:7.3f} {r['failed']:6d}  "
              f"{'yes' if r['sustain']['sustained'] else 'NO: ' + '; '.join(r['sustain']['why'])}")
    for name, r in result["runs"].items():
        print(f"{name:>10s} TTFT p50 / p90 by share cached: " + ", ".join(
            f"{k} ({c['requests']}) {c['ttft_p50']:.3f} / {c['ttft_p90']:.3f} s" for k, c in r["ttft_by_hit"].items()))
    for name, r in result["runs"].items():
        src = r.get("prompt_tokens_by_source") or {}
        print(f"{name:>10s} TPOT p50 {r['tpot_p50'] * 1e3:.2f} ms, p99 {r['tpot_p99'] * 1e3:.2f} ms; prompt tokens by "
              "source: " + ", ".join(f"{k} {v:.1%}" for k, v in src.items()))
    for name, r in result["runs"].items():
        nodes = r.get("at_nodes") or {}
        print(f"{name:>10s} mean TTFT {r['ttft_mean']:.3f} s: " + ", ".join(
            f"{role} queue {v['queue_s']:.3f} s, prompt {v['prefill_s']:.3f} s" for role, v in nodes.items())
            + f"; rest of the path {r.get('ttft_path_s')} s; decode node stages " + ", ".join(
                f"{stage} {s:.3f} s" for stage, s in (nodes.get("decode") or {}).get("transfer_s", {}).items()))
    t = result["targets"]
    if "unlimited_hit_rate" in result["trace"]:  # prefix-groups' own statistics
        print(f"oracle (unlimited) {result['trace']['unlimited_hit_rate']:.1%}, LRU of the fleet's KV "
              f"{result['trace']['capacity_lru_hit_rate']:.1%}")
    if t.get("hit_rate_host_over_unlimited") is not None:
        print(f"hit rate host / unlimited {t['hit_rate_host_over_unlimited']} (>= {TARGET_HIT_RATIO})")
    if t.get("ttft_p50_none_over_host") is not None:
        print(f"TTFT p50 none / host {t['ttft_p50_none_over_host']} (>= {TARGET_TTFT_RATIO})")
    if t.get("tpot_p99_host_over_none") is not None:
        print(f"TPOT p99 host / none {t['tpot_p99_host_over_none']} (<= {TARGET_TPOT_RATIO}), hit rate host / none "
              f"{t['hit_rate_host_over_none']} (>= 1.0)")
    if not t["sustained"]:
        print("NOT SUSTAINED: this machine did not keep the simulation's pace in every run; the figures above "
              "are not the deployment's")


if __name__ == "__main__":
    sys.exit(main())
