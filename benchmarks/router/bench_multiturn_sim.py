"""Does reusing a prefix wherever the fleet holds it pay on multi-turn chat at 16 nodes?
(issue 38) ``--prefill`` + ``--decode`` simulated ``llama3-8b-h100`` nodes (8 + 8) replay the
``chat`` trace (``make-trace --preset chat``: conversations of ~6 turns over shared system
prompts, some tool results) closed-loop: each turn is sent the trace's think time after the
previous answer ended, its prompt holding that answer's generated tokens
(replay/conversation.py), so the decode node that served a turn holds most of the next one.
Through the real router, Redis and KV transport (``splitserve replay``), twice in one run:

    today   cache-aware routing as it was: every prompt to a prefill node
            (--score-weights local_prefill_tokens=0 --no-prefix-pull)
    reuse   the router's defaults: a decode node holding most of the prompt prefills the rest
            itself, and a node lacking a prefix another holds pulls it

    .venv/bin/python benchmarks/router/bench_multiturn_sim.py        # ~8 min here

Reported per setup (trace seconds): TTFT p50/p99 (all turns, and later turns alone), TPOT p99 (per request, from the streamed
tokens), the hit rate (prompt tokens the responses report cached / prompt tokens: device
hits and pulled blocks alike), the pooled bound (one shared prefix cache that never evicts,
generated tokens included: Conversations.pooled_hits) and hit / bound, and the prompt
tokens by source from the nodes' metrics (replay/run.py ``prompt_token_sources``:
decode-side reuse, prefill-node hits, pulled, computed). Targets: TTFT p50 today / reuse
>= 1.5, hit / bound (reuse) >= 0.95, TPOT p99 reuse / today <= 1.10.

Beside them, from the router's ``/debug/decisions`` (its last KEEP, every request of the
default trace), each path's requests and TTFT p50 / p90 (``ttft_by_path``): which node
computed the prompt (the decode node itself, or a prefill node) and where its prefix came
from (none, the node's own cache, a pull). That splits "today" (the prefill node's step, then
the history's KV to the decode node) from decode-side reuse (one decode step).

Each run is checked for keeping its pace (replay/plan_check.py ``judge_pace``: sends on
schedule, no node's steps behind their simulated time, transfers within the modelled
network), every answer reproduced (the next turn's prompt holds what the node generated)
and no request failed; otherwise the figures are not printed and the JSON says why. Writes
``benchmarks/results/<out>.json`` (with the command) and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import tempfile
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from splitserve.benchmarks.harness import RESULTS
from splitserve.benchmarks.loadgen.replay.generate import PRESETS, TraceSpec, generate
from splitserve.benchmarks.loadgen.replay.plan_check import judge_replay
from splitserve.benchmarks.loadgen.replay.run import ReplayConfig, percentile, print_summary, run_replay
from splitserve.common.trace import TraceRequest, dump_trace, load_trace
from splitserve.common.trace import summarize as trace_summary

SETUPS = ("today", "reuse")
TARGET_TTFT = 1.5  # TTFT p50 today / reuse, at least
TARGET_HIT = 0.95  # hit rate / pooled bound (reuse), at least
TARGET_TPOT = 1.10  # TPOT p99 reuse / today, at most


def setups() -> dict[str, dict]:
    """Each setup's replay settings (module docstring)."""
    return {"today": {"score_weights": (("local_prefill_tokens", 0.0),), "router_args": ("--no-prefix-pull",)},
            "reuse": {"score_weights": (), "router_args": ()}}


def sustain(r: dict) -> dict:
    """judge_replay's verdict, also refusing answers not reproduced."""
    lost = r["conversations"]["answers_not_reproduced"]
    return judge_replay(r, [f"{lost} answers were not the tokens the next turn held"] if lost else [])


def ttft_by_path(decisions: Iterable[dict], speedup: float) -> dict:
    """Per path ("<decode|prefill> node, <none|own|pull>": the node that computed the prompt,
    and where its cached prefix came from), the requests and their router-measured TTFT
    p50 / p90 in trace seconds (wall x ``speedup``), of ``decisions`` (/debug/decisions
    records; those without a delivered TTFT left out)."""
    paths: dict[str, list[float]] = {}
    for d in decisions:
        if d["delivered_ttft_s"] is not None:
            where = "decode" if d["prefill"] is None else "prefill"
            paths.setdefault(f"{where} node, {d['reuse']}", []).append(d["delivered_ttft_s"] * speedup)
    return {k: {"requests": len(v), "ttft_p50": round(percentile(v, 0.5), 4), "ttft_p90": round(percentile(v, 0.9), 4)}
            for k, v in sorted(paths.items())}


def read_decisions(url: str) -> dict:
    """The router's /debug/decisions with its last KEEP routing decisions
    (router/routing/decisions.py): ``{"decisions": [...]}``."""
    from splitserve.router.routing.decisions import KEEP
    with urllib.request.urlopen(f"{url}/debug/decisions?limit={KEEP}", timeout=10) as r:
        return json.loads(r.read())


def later_turns(trace: list[TraceRequest]) -> list[bool]:
    """Per line (load_trace's order: by timestamp), whether it continues a conversation."""
    seen: set[int | None] = set()
    out = []
    for r in trace:
        out.append(r.conversation in seen)
        seen.add(r.conversation)
    return out


def figures(r: dict, later: list[bool]) -> dict:
    """What the comparison reads of one replay; ``later``: ``later_turns`` of its trace."""
    ttft = [row[0] for row, yes in zip(r["per_request"], later) if yes and row[0] is not None]
    kept = ("requests", "failed", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p99", "hit_rate",
            "oracle_hit_rate", "hit_rate_vs_oracle", "prompt_tokens_by_source", "max_mean_load", "conversations",
            "at_nodes", "transfers", "schedule", "sim_overrun_s", "wall_s", "output_tokens")
    return {"later_turns_ttft_p50": round(percentile(ttft, 0.5), 3),
            "later_turns_ttft_p99": round(percentile(ttft, 0.99), 3), **{k: r[k] for k in kept},
            "ttft_by_path": ttft_by_path((r["at_end"] or {}).get("decisions", []), r["speedup"])}


def targets(runs: dict) -> dict:
    today, reuse = runs["today"], runs["reuse"]
    ttft = today["ttft_p50"] / reuse["ttft_p50"] if reuse["ttft_p50"] else None
    tpot = reuse["tpot_p99"] / today["tpot_p99"] if today["tpot_p99"] else None
    return {"ttft_p50_today_over_reuse": ttft and round(ttft, 2),
            "hit_over_bound_reuse": reuse["hit_rate_vs_oracle"],
            "tpot_p99_reuse_over_today": tpot and round(tpot, 3),
            "met": {"ttft": ttft is not None and ttft >= TARGET_TTFT,
                    "hit": (reuse["hit_rate_vs_oracle"] or 0) >= TARGET_HIT,
                    "tpot": tpot is not None and tpot <= TARGET_TPOT}}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = [s for s in SETUPS if s in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    xs = range(len(names))
    for ax, keys, title in ((axes[0], ("ttft_p50", "ttft_p99"), "TTFT, trace seconds"),
                            (axes[1], ("tpot_p50", "tpot_p99"), "TPOT, trace seconds")):
        for j, key in enumerate(keys):
            ax.bar([x + (j - 0.5) * 0.4 for x in xs], [runs[n][key] for n in names], 0.4, label=key.split("_")[1])
        ax.set_xticks(list(xs), names)
        ax.set_title(title)
        ax.legend(fontsize=8)
    bottom = [0.0] * len(names)
    for source, color in (("decode_node_hits", "tab:green"), ("pulled", "tab:purple"),
                          ("prefill_node_hits", "tab:blue"), ("computed", "tab:gray")):
        shares = [(runs[n]["prompt_tokens_by_source"] or {}).get(source, 0.0) for n in names]
        axes[2].bar(names, shares, bottom=bottom, color=color, label=source)
        bottom = [b + s for b, s in zip(bottom, shares)]
    for n, x in zip(names, xs):
        axes[2].hlines(runs[n]["oracle_hit_rate"], x - 0.4, x + 0.4, colors="black", linestyles="--",
                       label="pooled bound" if x == 0 else None)
    axes[2].set_title("prompt tokens by source")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"{result['prefill']}P:{result['decode']}D x {result['profile']}, chat trace closed-loop "
                 f"(seed {result['seed']}), speed-up {result['speedup']}"
                 + ("" if result["sustained"] else ": NOT SUSTAINED"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict) -> None:
    runs = result["runs"]
    for name, r in runs.items():
        s = r["sustain"]
        print(f"{name:>6s}: {'sustained' if s['sustained'] else 'NOT SUSTAINED: ' + '; '.join(s['why'])}")
    if not result["sustained"]:
        print("no figures: a run did not keep the simulation's pace (or lost requests); see the JSON's sustain")
        return
    print(f"\n{'setup':>6s} {'TTFT p50':>9s} {'p99':>7s} {'later p50':>10s} {'p99':>7s} {'TPOT p99':>9s} {'hit':>6s} "
          f"{'bound':>6s} {'hit/bd':>7s}  by source")
    for name, r in runs.items():
        src = r["prompt_tokens_by_source"] or {}
        print(f"{name:>6s} {r['ttft_p50']:9.3f} {r['ttft_p99']:7.3f} {r['later_turns_ttft_p50']:10.3f} "
              f"{r['later_turns_ttft_p99']:7.3f} {r['tpot_p99'] * 1000:7.2f}ms "
              f"{r['hit_rate']:6.1%} {r['oracle_hit_rate']:6.1%} {r['hit_rate_vs_oracle']:7.3f}  "
              + ", ".join(f"{k} {v:.1%}" for k, v in src.items()))
    print("\nTTFT by path (the router's last decisions; trace seconds):")
    for name, r in runs.items():
        for path, f in r["ttft_by_path"].items():
            print(f"{name:>6s}  {path:<20s} {f['requests']:4d} requests  p50 {f['ttft_p50']:.4f}  p90 {f['ttft_p90']:.4f}")
    if "targets" not in result:
        return
    t = result["targets"]
    print(f"TTFT p50 today / reuse {t['ttft_p50_today_over_reuse']} (>= {TARGET_TTFT}), hit / bound (reuse) "
          f"{t['hit_over_bound_reuse']} (>= {TARGET_HIT}), TPOT p99 reuse / today "
          f"{t['tpot_p99_reuse_over_today']} (<= {TARGET_TPOT})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--prefill", type=int, default=8, help="prefill nodes")
    ap.add_argument("--decode", type=int, default=8, help="decode nodes")
    ap.add_argument("--rate", type=float, default=2.0, help="new conversations per trace second")
    ap.add_argument("--duration", type=float, default=20.0, help="trace seconds in which conversations start")
    ap.add_argument("--think", type=float, default=5.0,
                    help="mean seconds a user thinks between an answer and the next turn (the preset's: 15)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speedup", type=float, default=0.5,
                    help="trace seconds per wall second (at 1 this machine moves the KV stand-ins 3-6%% of "
                         "the TTFT behind the modelled network)")
    ap.add_argument("--max-output-tokens", type=int, default=64, help="cap on each answer")
    ap.add_argument("--fleet-procs", type=int, default=4, help="processes the simulated nodes share")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--out", default="multiturn_sim", help="results/<out>.json and .png")
    args = ap.parse_args(argv)
    spec = PRESETS["chat"]
    assert isinstance(spec, TraceSpec)
    trace = generate(dataclasses.replace(spec, rate=args.rate, duration_s=args.duration, mean_think_s=args.think,
                                         seed=args.seed))
    settings = setups()
    result: dict = {"command": " ".join(["benchmarks/router/bench_multiturn_sim.py",
                                          *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
                    "profile": args.profile, "prefill": args.prefill, "decode": args.decode, "seed": args.seed,
                    "speedup": args.speedup, "max_output_tokens": args.max_output_tokens,
                    "trace": {"preset": "chat", "rate": args.rate, "duration_s": args.duration, "think_s": args.think,
                              **trace_summary(trace)},
                    "setups": {n: {k: list(v) for k, v in settings[n].items()} for n in args.setups}, "runs": {}}
    print(f"== trace: {result['trace']}", file=sys.stderr, flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{args.out}.json"
    with tempfile.TemporaryDirectory(prefix="multiturn-") as tmp:
        path = Path(tmp) / "chat.jsonl"
        dump_trace(trace, path)
        later = later_turns(load_trace(path))  # the replay's order
        for name in args.setups:
            s = settings[name]
            print(f"== {name}: score weights {dict(s['score_weights'])}, router {list(s['router_args'])}",
                  file=sys.stderr, flush=True)
            r = run_replay(ReplayConfig(trace=str(path), prefill_nodes=args.prefill, decode_nodes=args.decode,
                                        profile=args.profile, speedup=args.speedup,
                                        max_output_tokens=args.max_output_tokens, fleet_procs=args.fleet_procs,
                                        score_weights=s["score_weights"], router_args=s["router_args"]),
                           at_end=lambda cluster: read_decisions(cluster.url))
            print_summary(r)
            result["runs"][name] = {**figures(r, later), "sustain": sustain(r)}
            out.write_text(json.dumps(result, indent=1))  # after each setup: a late crash keeps what ran
    result["sustained"] = all(r["sustain"]["sustained"] for r in result["runs"].values())
    if set(SETUPS) <= set(result["runs"]) and result["sustained"]:
        result["targets"] = targets(result["runs"])
    out.write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / f"{args.out}.png")
    report(result)
    print(f"wrote {out} and {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
