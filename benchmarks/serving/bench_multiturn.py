"""Multi-turn chat on real nodes: does decode-side prefix reuse pay on this CPU? (issue 38)

    .venv/bin/python benchmarks/serving/bench_multiturn.py              # ~11 min here (3 rounds)
    .venv/bin/python benchmarks/serving/bench_multiturn.py --quick      # one short round

Workload: ``--conversations`` chats of ``--turns`` turns through the OpenAI chat API (the
bundled model, temperature 0, ``--max-tokens`` per answer). Each turn's prompt is the whole
conversation so far: a long system prompt, every earlier question and the model's own
answers, then a new question. The conversations run at once, each turn after the previous
answer, so the decode node always has other streams running while a prompt arrives.

The decode node holds each conversation's previous turn, prompt and answer (its blocks are
cached as they fill); a prefill node holds at most the prompts it computed. Setups, each a
fresh cluster of ``--prefill`` prefill nodes and one decode node with small device pools,
alternated ``--rounds`` times:

    remote prefill     the defaults before issue 38: every prompt goes to a prefill node, which
                       uses its own cache only (router --no-prefix-pull
                       --score-weights local_prefill_tokens=0)
    pull only          every prompt goes to a prefill node, which pulls a longer cached prefix
                       from another node first when that pays (--score-weights local_prefill_tokens=0)
    defaults           today's: the decode node prefills a prompt itself when it holds part of it
                       and at most 512 tokens are not cached there (decode-side reuse, chunked by
                       its --local-prefill-budget), and the node that computes pulls when that pays

Reported per setup: TTFT p50 and p99 (turns 2.., where reuse is possible, and all turns), TPOT
p99 (per request: (last token - first token) / (tokens - 1): the other streams' cost of
the prefills the decode node ran), and the prompt tokens by where they came from: computed,
the decode node's own cache when it prefilled (decode-side reuse), pulled from another node
(the nodes' kv_pull_tokens_total), and the prefilling node's own cache otherwise (from the
router's decisions and the responses' cached tokens). The spread of a setup's TTFT p50 over its
rounds says whether the machine sustained the run (> 1.5x: flagged, not a figure).
Writes benchmarks/results/multiturn_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request
from typing import Any, NamedTuple

import openai

from splitserve.benchmarks.harness import MODEL, RESULTS, check_alive, node_counters
from splitserve.common import metric_names as names
from splitserve.deploy.launcher import Cluster

# setup -> its router flags
SETUPS = {"remote prefill": ["--no-prefix-pull", "--score-weights", "local_prefill_tokens=0"],
          "pull only": ["--score-weights", "local_prefill_tokens=0"],
          "defaults": []}
SPREAD_LIMIT = 1.5  # a setup's TTFT p50 over its rounds, max / min, beyond which the run is not sustained
SYSTEM = ("You are a patient assistant who explains the weather, the sea and the sky to curious people. "
          "Answer in plain words, in two or three sentences, and never use lists. ") * 6
QUESTIONS = ["Why is the sky blue?", "Why are sunsets red?", "What makes waves?", "Why is the sea salty?",
             "How do clouds form?", "What is fog?", "Why does it rain?", "What causes thunder?",
             "How cold is the deep sea?", "Why do tides happen?", "What is a rainbow?", "Why is snow white?"]


class Turn(NamedTuple):
    conversation: int
    turn: int  # 1-based
    ttft_s: float
    tpot_s: float | None  # None: one token
    prompt_tokens: int
    cached_tokens: int  # as the response's usage reports them


async def one_turn(client: openai.AsyncOpenAI, messages: list[Any], max_tokens: int) -> tuple[str, float, float | None,
                                                                                                 int, int]:
    """(answer text, TTFT s, TPOT s or None, prompt tokens, cached prompt tokens) of one streamed turn."""
    start = time.perf_counter()
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    text, times, usage = [], [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert times and usage is not None, "the stream carried no text or no usage"
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    details = usage.prompt_tokens_details
    return "".join(text), times[0] - start, tpot, usage.prompt_tokens, (details.cached_tokens or 0) if details else 0


async def conversation(client: openai.AsyncOpenAI, index: int, turns: int, max_tokens: int) -> list[Turn]:
    messages: list[Any] = [{"role": "system", "content": SYSTEM}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[(index + t) % len(QUESTIONS)]})
        answer, ttft, tpot, prompt, cached = await one_turn(client, messages, max_tokens)
        messages.append({"role": "assistant", "content": answer})
        out.append(Turn(index, t + 1, ttft, tpot, prompt, cached))
    return out


def decisions(url: str, limit: int) -> list[dict]:
    with urllib.request.urlopen(f"{url}/debug/decisions?limit={limit}", timeout=10) as r:
        return json.loads(r.read())["decisions"]


def run_setup(name: str, args) -> dict:
    cluster = Cluster(prefill_nodes=args.prefill, decode_nodes=1, kv_backend="shm",
                      kv_cache_memory=args.kv_cache_memory, router_args=SETUPS[name])
    with cluster:
        async def all_conversations():
            async with openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0,
                                          timeout=600) as client:
                await one_turn(client, [{"role": "user", "content": "Hello."}], 4)  # warm-up
                runs = await asyncio.gather(*(conversation(client, i, args.turns, args.max_tokens)
                                              for i in range(args.conversations)))
            return [t for r in runs for t in r]
        turns = asyncio.run(all_conversations())
        check_alive(cluster)
        made = decisions(cluster.url, args.conversations * args.turns)
        pulled = sum(node_counters(cluster, (names.KV_PULL_TOKENS,)).values())
    return {"turns": [t._asdict() for t in turns], "decisions": made, "pulled_tokens": pulled}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(rounds: list[dict]) -> dict:
    turns = [t for r in rounds for t in r["turns"]]
    later = [t["ttft_s"] for t in turns if t["turn"] > 1]
    tpots = [t["tpot_s"] for t in turns if t["tpot_s"] is not None]
    made = [d for r in rounds for d in r["decisions"]]
    prompt = sum(d["prompt_tokens"] for d in made)
    local = [d for d in made if d["prefill"] is None]
    remote = [d for d in made if d["prefill"] is not None]
    cached = lambda ds: sum(d.get("delivered_cached_tokens") or 0 for d in ds)
    pulled = sum(r["pulled_tokens"] for r in rounds)
    share = lambda tokens: round(tokens / prompt, 3) if prompt else 0.0
    p50s = [statistics.median(t["ttft_s"] for t in r["turns"] if t["turn"] > 1) for r in rounds]
    return {
        "requests": len(turns),
        "ttft_p50_ms": round(statistics.median(t["ttft_s"] for t in turns) * 1000, 1),
        "ttft_p99_ms": round(pct([t["ttft_s"] for t in turns], 0.99) * 1000, 1),
        "later_turns_ttft_p50_ms": round(statistics.median(later) * 1000, 1),
        "later_turns_ttft_p99_ms": round(pct(later, 0.99) * 1000, 1),
        "tpot_p50_ms": round(statistics.median(tpots) * 1000, 1),
        "tpot_p99_ms": round(pct(tpots, 0.99) * 1000, 1),
        "prompt_tokens": prompt,
        "share_decode_side_reuse": share(cached(local)),
        "share_pulled": share(pulled),
        "share_local_hits": share(cached(remote) - pulled),
        "share_computed": share(prompt - cached(local) - cached(remote)),
        "requests_prefilled_by_decode_node": len(local),
        "requests_that_pulled": sum(1 for d in made if d.get("reuse") == "pull"),
        "round_ttft_p50_spread": round(max(p50s) / min(p50s), 2) if len(p50s) > 1 else 1.0,
    }


def plot(summary: dict, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(summary)
    for ax, keys, title in ((axes[0], ("later_turns_ttft_p50_ms", "later_turns_ttft_p99_ms"), "TTFT, turns 2.. (ms)"),
                            (axes[1], ("tpot_p50_ms", "tpot_p99_ms"), "TPOT (ms)")):
        width = 0.35
        for i, key in enumerate(keys):
            ax.bar([x + i * width for x in range(len(names))], [summary[n][key] for n in names], width,
                   label=key.split("_")[-2])
        ax.set_xticks([x + width / 2 for x in range(len(names))], names)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prefill", type=int, default=2, help="prefill nodes (one decode node)")
    ap.add_argument("--kv-cache-memory", default="256MiB", help="each node's device pool")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 conversations x 2 turns, one round")
    ap.add_argument("--out", default=str(RESULTS / "multiturn_cpu.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.rounds, args.max_tokens = 2, 2, 1, 8
    results: dict[str, list[dict]] = {s: [] for s in SETUPS}
    for r in range(args.rounds):
        for name in (list(SETUPS) if r % 2 == 0 else list(SETUPS)[::-1]):
            t0 = time.perf_counter()
            results[name].append(run_setup(name, args))
            print(f"round {r + 1}/{args.rounds} {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    summary = {name: summarize(runs) for name, runs in results.items()}
    sustained = all(s["round_ttft_p50_spread"] <= SPREAD_LIMIT for s in summary.values())
    out = {"setups": summary, "sustained": sustained, "args": vars(args),
           "runs": {name: [r["turns"] for r in runs] for name, runs in results.items()}}
    if not sustained:
        print(f"NOT SUSTAINED: a setup's TTFT p50 varied more than {SPREAD_LIMIT}x over its rounds "
              "(the machine, not the setups); the figures below are not a comparison")
    for name, s in summary.items():
        print(f"{name:>18}: TTFT p50 {s['later_turns_ttft_p50_ms']:.0f} ms p99 {s['later_turns_ttft_p99_ms']:.0f} ms "
              f"(turns 2..), TPOT p99 {s['tpot_p99_ms']:.0f} ms; prompt tokens: decode-side reuse "
              f"{s['share_decode_side_reuse']:.0%}, pulled {s['share_pulled']:.0%}, local hits "
              f"{s['share_local_hits']:.0%}, computed {s['share_computed']:.0%}")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    if not args.quick:
        plot(summary, args.out.replace(".json", ".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
