"""Does prefix pull spread a hot prefix over the prefill nodes? (issue 38) ``--prefill`` +
``--decode`` simulated ``llama3-8b-h100`` nodes (12 + 4) replay a hot-prefix trace through
the real router, Redis and KV transport (``splitserve replay``):

    hot      HOT_SHARE of the requests: one shared prefix of ``--prefix-tokens`` (4096)
             + a unique suffix (lognormal, mean ``--suffix-tokens``)
    unique   the rest: prompts of about the prefix's length sharing nothing
    arrivals Poisson, ``--rate`` per trace second for ``--duration`` seconds

twice in one run, only the router's prefix pull told apart:

    no-pull  --no-prefix-pull: a node lacking the prefix computes it (cache-aware routing
             as it was: the hot requests crowd the nodes that hold it, or pay 4k tokens)
    pull     the router's defaults: a node lacking it fetches its KV from one that holds it

    .venv/bin/python benchmarks/router/bench_hot_prefix.py          # ~6 min here

Reported per setup: TTFT
p50/p99 (trace seconds), the prefill nodes' busy time max / mean (the replay's
``max_mean_load``), the prompt tokens by source (replay/run.py ``prompt_token_sources``), and
how many nodes hold the whole prefix in the Redis prefix index at the end (common/kv_index.py:
each node's set of block hashes), by role. Each run is checked for keeping its pace
(replay/plan_check.py ``judge_pace``) and for failed requests; a run that did not is reported
as not sustained, without figures. Writes ``benchmarks/results/<out>.json`` (with the
command) and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np

from splitserve.benchmarks.harness import RESULTS
from splitserve.benchmarks.loadgen.replay.plan_check import judge_replay
from splitserve.benchmarks.loadgen.replay.run import ReplayConfig, node_block_size, print_summary, run_replay
from splitserve.common.bundled import BUNDLED_MODEL_ID
from splitserve.common.hashing import hash_blocks
from splitserve.common.prompt_ref import PromptKeys
from splitserve.common.trace import HASH_BLOCK, TraceRequest, dump_trace, prompt_tokens
from splitserve.common.trace import summarize as trace_summary

SETUPS = ("no-pull", "pull")
PULL_FLAG = "--no-prefix-pull"  # the router flag that turns prefix pull off
HOT_SHARE = 0.8


def hot_trace(rate: float, duration_s: float, prefix_tokens: int, suffix_tokens: int, seed: int) -> list[TraceRequest]:
    """The trace of the module docstring (hash ids of HASH_BLOCK tokens: the prefix's are
    0 .. prefix_tokens / HASH_BLOCK - 1, every other id is one request's own)."""
    if prefix_tokens % HASH_BLOCK:
        raise ValueError(f"prefix_tokens: a multiple of {HASH_BLOCK}, got {prefix_tokens}")
    rng = np.random.default_rng(seed)
    prefix = list(range(prefix_tokens // HASH_BLOCK))
    next_id = len(prefix)
    out, t = [], float(rng.exponential(1 / rate))
    while t < duration_s:
        suffix = max(1, int(rng.lognormal(math.log(suffix_tokens) - 0.125, 0.5)))
        ids = prefix if rng.random() < HOT_SHARE else []
        length = (prefix_tokens if ids else int(rng.integers(prefix_tokens // 2, prefix_tokens * 3 // 2))) + suffix
        own = -(-length // HASH_BLOCK) - len(ids)
        out.append(TraceRequest(round(t * 1000, 3), length, 4, ids + list(range(next_id, next_id + own))))
        next_id += own
        t += float(rng.exponential(1 / rate))
    return out


def prefix_holders(redis_url: str, prefix: list[int], block_size: int) -> dict:
    """Nodes whose entry in the Redis prefix index holds every block of the token list
    ``prefix``, by role, and those holding any of it."""
    from splitserve.common.kv_index import KVIndex
    from splitserve.common.node_registry import NodeRegistry

    hashes = set(hash_blocks(prefix, block_size, PromptKeys(model=BUNDLED_MODEL_ID).hash_keys()))

    async def read() -> dict:
        index, registry = KVIndex(redis_url), NodeRegistry(redis_url)
        try:
            roles = {n.node_id: n.role for n in await registry.list_nodes()}
            held = {node: hashes & await index.members(node, epoch) for node, epoch in await index.published_seqs()}
        finally:
            await index.close()
            await registry.close()
        whole = sorted(n for n, h in held.items() if h == hashes)
        return {"blocks": len(hashes), "whole": {role: sum(roles.get(n) == role for n in whole)
                                                for role in ("prefill", "decode")},
                "any": sum(bool(h) for h in held.values()), "nodes": whole}

    return asyncio.run(read())


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = [s for s in SETUPS if s in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    xs = list(range(len(names)))
    for j, key in enumerate(("ttft_p50", "ttft_p99")):
        axes[0].bar([x + (j - 0.5) * 0.4 for x in xs], [runs[n][key] for n in names], 0.4,
                    label=key.split("_")[1])
    axes[0].set_title("TTFT, trace seconds")
    axes[0].legend(fontsize=8)
    axes[1].bar(names, [runs[n]["max_mean_load"] or 0 for n in names])
    axes[1].set_title("prefill busy time, max / mean")
    axes[2].bar(names, [runs[n]["at_end"]["whole"]["prefill"] for n in names], label="prefill")
    axes[2].bar(names, [runs[n]["at_end"]["whole"]["decode"] for n in names],
                bottom=[runs[n]["at_end"]["whole"]["prefill"] for n in names], label="decode")
    axes[2].set_title("nodes holding the hot prefix at the end")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(xs, names)
    fig.suptitle(f"{result['prefill']}P:{result['decode']}D x {result['profile']}, {HOT_SHARE:.0%} of requests on one "
                 f"{result['prefix_tokens']}-token prefix, speed-up {result['speedup']}"
                 + ("" if result["sustained"] else ": NOT SUSTAINED"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict) -> None:
    for name, r in result["runs"].items():
        s = r["sustain"]
        print(f"{name:>8s}: {'sustained' if s['sustained'] else 'NOT SUSTAINED: ' + '; '.join(s['why'])}")
    if not result["sustained"]:
        print("no figures: a run did not keep the simulation's pace (or lost requests); see the JSON's sustain")
        return
    print(f"\n{'setup':>8s} {'TTFT p50':>9s} {'p99':>7s} {'busy max/mean':>14s} {'holders P/D':>12s}  by source")
    for name, r in result["runs"].items():
        held = r["at_end"]["whole"]
        print(f"{name:>8s} {r['ttft_p50']:9.3f} {r['ttft_p99']:7.3f} {r['max_mean_load']:14} "
              f"{held['prefill']:>6}/{held['decode']:<5}  "
              + ", ".join(f"{k} {v:.1%}" for k, v in (r["prompt_tokens_by_source"] or {}).items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--prefill", type=int, default=12, help="prefill nodes")
    ap.add_argument("--decode", type=int, default=4, help="decode nodes")
    ap.add_argument("--rate", type=float, default=32.0, help="requests per trace second")
    ap.add_argument("--duration", type=float, default=45.0, help="trace seconds")
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--suffix-tokens", type=int, default=128, help="mean unique tokens after the hot prefix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speedup", type=float, default=0.5, help="trace seconds per wall second")
    ap.add_argument("--fleet-procs", type=int, default=4, help="processes the simulated nodes share")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--out", default="hot_prefix", help="results/<out>.json and .png")
    args = ap.parse_args(argv)
    trace = hot_trace(args.rate, args.duration, args.prefix_tokens, args.suffix_tokens, args.seed)
    prefix = prompt_tokens(next(r for r in trace if r.input_length > args.prefix_tokens
                                and r.hash_ids[0] == 0))[:args.prefix_tokens]
    block_size = node_block_size(args.profile)
    result: dict = {"command": " ".join(["benchmarks/router/bench_hot_prefix.py",
                                          *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
                    "profile": args.profile, "prefill": args.prefill, "decode": args.decode, "seed": args.seed,
                    "speedup": args.speedup, "prefix_tokens": args.prefix_tokens, "hot_share": HOT_SHARE,
                    "trace": {"rate": args.rate, "duration_s": args.duration, "suffix_tokens": args.suffix_tokens,
                              **trace_summary(trace)},
                    "runs": {}}
    print(f"== trace: {result['trace']}", file=sys.stderr, flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{args.out}.json"
    with tempfile.TemporaryDirectory(prefix="hot-prefix-") as tmp:
        path = Path(tmp) / "hot.jsonl"
        dump_trace(trace, path)
        for name in args.setups:
            router_args = (PULL_FLAG,) if name == "no-pull" else ()
            print(f"== {name}: router {list(router_args)}", file=sys.stderr, flush=True)
            r = run_replay(ReplayConfig(trace=str(path), prefill_nodes=args.prefill, decode_nodes=args.decode,
                                        profile=args.profile, speedup=args.speedup, max_output_tokens=4,
                                        fleet_procs=args.fleet_procs, router_args=router_args),
                           at_end=lambda cluster: prefix_holders(cluster.redis_url, prefix, block_size))
            print_summary(r)
            print(f"  hot prefix held whole by {r['at_end']['whole']} nodes", file=sys.stderr, flush=True)
            result["runs"][name] = {**{k: r[k] for k in (
                "requests", "failed", "ttft_p50", "ttft_p90", "ttft_p99", "hit_rate", "oracle_hit_rate",
                "max_mean_load", "max_mean_requests", "prefill_busy_s_per_node", "prompt_tokens_by_source",
                "at_end", "at_nodes", "transfers", "schedule", "sim_overrun_s", "wall_s", "errors")},
                "router_args": list(router_args), "sustain": judge_replay(r)}
            out.write_text(json.dumps(result, indent=1))  # after each setup: a late crash keeps what ran
    result["sustained"] = all(r["sustain"]["sustained"] for r in result["runs"].values())
    out.write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / f"{args.out}.png")
    report(result)
    print(f"wrote {out} and {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
