"""DeepSeek-V3 on 64 simulated H200s, wide expert parallelism beside dense-TP nodes: one
long-context trace replayed (``splitserve replay``'s machinery: real router, real Redis,
simulated nodes) on

    wide-ep   prefill DP16/EP16 x 2 nodes + decode DP32/EP32 x 1 node (deployment
              deepseek-v3-p-dp16-d-dp32-h200): 32 + 32 simulated ranks, one GPU each
    tp8       deepseek-v3-tp8-h200 nodes (attention TP8 with the latent replicated on every
              rank, experts EP8): 4 prefill + 4 decode nodes of 8 GPUs

the same 64 GPUs, FP8 weights in both (deploy/planner/sim_profiles.toml; roofline, not calibrated).
A DP rank's step carries the engine's all_gather + all_reduce over its node's ranks (RDMA
beyond 8 ranks: deploy/planner/roofline.py MoeCost), the ranks taken as evenly loaded.

    .venv/bin/python benchmarks/router/bench_deepseek_wide_ep.py     # 237 requests over 720 s: ~32 min here
                                                                     # (wide-ep at 2x, tp8 at 0.5x)

Per layout: tokens/s per GPU served (prompt + output tokens of the requests that finished,
over the trace's span, / 64), the prefill ranks' busy share and the prompt tokens they
computed per busy GPU-second (what a GPU of that layout sustains when kept busy), TTFT
p50/p90/p99, the prefix hit rate, failures. Each run's ``sustain`` says whether this
machine kept the trace's pace (sends on schedule, nodes not behind their simulated steps,
transfers not behind the modelled network); a run that did not is flagged NOT SUSTAINED
and its figures are not the trace's. Outputs are capped (``--max-output-tokens``) to keep
64 simulated nodes within two cores; the trace's rate is scaled down from the 64-node
routing benchmark's for the same reason (``--conversation-rate``: the long-context preset's
0.5 new conversations a second for 120 s, 237 requests over 720 s, where the 64-node routing
run had 4.0 for 960 s): a light load for 64 GPUs, so TTFT is mostly each layout's own
compute and collective, and tokens/s per GPU served is the trace's load, the same for both
layouts while both keep up; the busy share and tokens per busy GPU-second tell them apart.
Writes ``benchmarks/results/replay_deepseek_wide_ep.json`` and ``.png``.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from splitserve.benchmarks.harness import RESULTS
from splitserve.benchmarks.loadgen.replay.generate import PRESETS, generate
from splitserve.benchmarks.loadgen.replay.plan_check import judge_pace
from splitserve.benchmarks.loadgen.replay.run import ReplayConfig, print_summary, run_replay
from splitserve.deploy.planner.sim_profiles import get_deployment
from splitserve.common.trace import dump_trace, summarize

GPUS = 64
# name -> (profile or deployment, prefill simulated nodes, decode simulated nodes, fleet description)
LAYOUTS = {
    "wide-ep": ("deepseek-v3-p-dp16-d-dp32-h200", 32, 32,
                "prefill DP16/EP16 x 2 nodes (32 ranks) + decode DP32/EP32 x 1 node (32 ranks)"),
    "tp8": ("deepseek-v3-tp8-h200", 4, 4, "prefill TP8/EP8 x 4 nodes + decode TP8/EP8 x 4 nodes"),
}


def gpus_of(profile: str, prefill: int, decode: int) -> int:
    d = get_deployment(profile)
    return prefill * d.prefill.node_gpus + decode * d.decode.node_gpus


def figures(name: str, r: dict, gpus: int, span_s: float) -> dict:
    """The side-by-side figures of one run (module docstring)."""
    span = max(span_s, 1e-9)
    done = [x for x in r["per_request"] if x[0] is not None]
    prompt = sum(x[1] for x in done)
    computed = sum(x[1] - x[2] for x in done)
    output = r["output_tokens"]
    busy = sum(r["prefill_busy_s_per_node"].values())  # trace seconds, one GPU per prefill node's GPUs
    dep = get_deployment(r["profile"])
    busy_gpu_s = busy * dep.prefill.node_gpus
    prefill_gpus = r["prefill_nodes"] * dep.prefill.node_gpus
    sustain = judge_pace(r["schedule"], r["sim_overrun_s"], r["wall_s"], r.get("transfers"))
    return {
        "layout": name, "fleet": LAYOUTS[name][3], "profile": r["profile"], "gpus": gpus,
        "prefill_sim_nodes": r["prefill_nodes"], "decode_sim_nodes": r["decode_nodes"],
        "requests": r["requests"], "failed": r["failed"],
        "tokens_per_s_per_gpu": round((prompt + output) / span / gpus, 1),
        "output_tokens_per_s_per_gpu": round(output / span / gpus, 2),
        "prefill_busy_share": round(busy_gpu_s / (prefill_gpus * span), 4),
        "computed_prompt_tokens_per_busy_gpu_s": round(computed / busy_gpu_s, 1) if busy_gpu_s else None,
        "ttft_p50": r["ttft_p50"], "ttft_p90": r["ttft_p90"], "ttft_p99": r["ttft_p99"],
        "hit_rate": r["hit_rate"], "oracle_hit_rate": r["oracle_hit_rate"],
        "speedup": r["speedup"], "sustained": sustain["sustained"], "not_sustained_why": sustain["why"],
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = [f"{r['layout']}{'' if r['sustained'] else ' (NOT SUSTAINED)'}" for r in rows]
    colors = ["tab:blue", "tab:orange"]
    axes[0].bar(names, [r["tokens_per_s_per_gpu"] for r in rows], color=colors)
    axes[0].set_title("tokens/s per GPU served (trace's load)")
    axes[1].bar(names, [r["computed_prompt_tokens_per_busy_gpu_s"] for r in rows], color=colors)
    axes[1].set_title("prompt tokens computed per busy prefill GPU-s")
    axes[2].bar(names, [r["ttft_p50"] for r in rows], color=colors, label="p50")
    axes[2].scatter(names, [r["ttft_p90"] for r in rows], marker="_", s=400, color="k", label="p90")
    axes[2].set_title("TTFT p50 (bars), p90 (ticks), s")
    axes[2].set_yscale("log")
    axes[2].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversation-rate", type=float, default=0.5,
                    help="new conversations per trace second (the long-context preset's is 0.5; the 64-node "
                         "routing run's 4.0)")
    ap.add_argument("--duration", type=float, default=120.0, help="trace seconds in which conversations start")
    ap.add_argument("--speedup", type=float, nargs="+", default=[2.0, 0.5],
                    help="per layout, in --layouts order (the last repeats): the TP8 nodes' KV transfers are "
                         "short in trace time, so this machine's few milliseconds per stand-in transfer "
                         "weigh on their TTFT unless the replay runs slower than real time")
    ap.add_argument("--max-output-tokens", type=int, default=16)
    ap.add_argument("--fleet-procs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--out", default="replay_deepseek_wide_ep")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    spec = dataclasses.replace(PRESETS["long-context"], rate=args.conversation_rate, duration_s=args.duration,
                               seed=args.seed)
    trace = generate(spec)
    path = RESULTS / f"{args.out}_trace.jsonl"
    dump_trace(trace, path)
    info = summarize(trace)
    print(f"== trace: {info}", file=sys.stderr, flush=True)
    runs, rows = {}, []
    try:
        for i, name in enumerate(args.layouts):
            speedup = args.speedup[min(i, len(args.speedup) - 1)]
            profile, prefill, decode, fleet = LAYOUTS[name]
            gpus = gpus_of(profile, prefill, decode)
            assert gpus == GPUS, (name, gpus)
            print(f"== {name}: {fleet} ({profile}), {gpus} GPUs", file=sys.stderr, flush=True)
            r = run_replay(ReplayConfig(trace=str(path), prefill_nodes=prefill, decode_nodes=decode,
                                        speedup=speedup, max_output_tokens=args.max_output_tokens,
                                        fleet_procs=args.fleet_procs, profile=profile))
            print_summary(r)
            rows.append(figures(name, r, gpus, info["span_s"]))
            runs[name] = {k: v for k, v in r.items() if k != "per_request"}
    finally:
        path.unlink(missing_ok=True)  # regenerated from the spec
    out = {"trace": info, "preset": "long-context", "conversation_rate": args.conversation_rate,
           "duration_s": args.duration, "speedup": {r["layout"]: r["speedup"] for r in rows},
           "max_output_tokens": args.max_output_tokens,
           "gpus": GPUS, "calibrated": False, "side_by_side": rows, "runs": runs}
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=1))
    plot(rows, RESULTS / f"{args.out}.png",
         f"DeepSeek-V3 on {GPUS} simulated H200s (FP8 weights, roofline not calibrated), long-context trace "
         f"{info['requests']} requests, {info['rate_per_s']} req/s")
    print(f"\n{'layout':>8} {'tok/s/GPU':>10} {'busy':>6} {'tok/busy GPU-s':>15} {'TTFT p50':>9} {'p90':>8} "
          f"{'hit':>6} {'failed':>6}  sustained")
    for r in rows:
        print(f"{r['layout']:>8} {r['tokens_per_s_per_gpu']:>10} {r['prefill_busy_share']:>6.1%} "
              f"{r['computed_prompt_tokens_per_busy_gpu_s']:>15} {r['ttft_p50']:>8.2f}s {r['ttft_p90']:>7.2f}s "
              f"{r['hit_rate']:>6.1%} {r['failed']:>6}  "
              + ("yes" if r["sustained"] else "NOT SUSTAINED: " + "; ".join(r["not_sustained_why"])))
    print(f"wrote {RESULTS / (args.out + '.json')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
