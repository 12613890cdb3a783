"""Does a host-memory tier pay on this CPU? Multi-turn long-context conversations whose
prefixes come back after other conversations pushed them out of the device KV cache, on
real nodes (router -> prefill -> decode, the bundled model), with and without a host tier
below a KV cache that holds about one conversation, in the same run.

    .venv/bin/python benchmarks/serving/bench_kv_tiers.py            # ~27 min here (2 rounds)

Workload (token-id prompts, so lengths are exact): ``--conversations`` conversations of
``--turns`` turns; turn 1 is a ``--first`` token prompt (a long system prompt and a
question), every later turn adds ``--added`` tokens (the answer and the next question) to
the previous prompt, up to ~7k tokens (the bundled model's context is 8k). Turns go round
robin over the conversations, one request at a time (TTFT is latency, not queueing), 4
output tokens each. Between two turns of a conversation the others' prompts (tens of
thousands of tokens) pass through a ``--kv-cache-memory`` device cache that holds one
prompt: without a tier every turn recomputes its whole prompt, with ``--kv-offload-memory``
of host memory the prefix comes back from there.

Setups, alternated ``--rounds`` times, each a fresh cluster: ``device only`` and ``host
tier``. Reported: TTFT p50 and p99 over all turns and over turns 2.. (where a prefix could
come back), the ratio (device only / host tier), the prefill node's prompt tokens served
by tier (device, host) and recomputed, and the bytes moved to and from host memory.
Writes benchmarks/results/kv_tiers_cpu.json and kv_tiers_cpu.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import openai

from splitserve.benchmarks.harness import MODEL, RESULTS, check_alive, node_counters
from splitserve.common import metric_names as n
from splitserve.deploy.launcher import Cluster, TierFlags

SETUPS = ("device only", "host tier")
BLOCK_SIZE = 16


def conversations(n: int, turns: int, first: int, added: int, seed: int) -> list[list[list[int]]]:
    """[conversation][turn] -> the prompt (token ids): each turn extends the one before."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(100, 49000) for _ in range(first)]
        convo = [list(prompt)]
        for _ in range(turns - 1):
            prompt = prompt + [rng.randrange(100, 49000) for _ in range(added)]
            convo.append(list(prompt))
        out.append(convo)
    return out


def ttft(client: openai.OpenAI, prompt: list[int]) -> float:
    start = time.perf_counter()
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text is not None:
            first = time.perf_counter() - start
    assert first is not None, "the stream carried no text"
    return first


def run_setup(name: str, args, convos, seed: int) -> dict:
    tiers = TierFlags(args.kv_offload_memory, None, None) if name == "host tier" else None
    cluster = Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="shm", kv_cache_memory=args.kv_cache_memory,
                      cpus={"prefill": (0,), "decode": (1,), "router": (1,)}, kv_offload=tiers)
    samples: list[tuple[int, float]] = []  # (turn, seconds)
    with cluster:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=600)
        ttft(client, [random.Random(seed).randrange(100, 49000) for _ in range(64)])  # warm-up
        base = node_counters(cluster, (n.PREFIX + "prefix_cache", n.PREFIX + "kv_offload"))
        for turn in range(args.turns):
            for c, convo in enumerate(convos):
                t = ttft(client, convo[turn])
                samples.append((turn + 1, t))
                print(f"  {name}: turn {turn + 1} conversation {c}: {len(convo[turn])} tokens, "
                      f"TTFT {t * 1000:.0f} ms", flush=True)
        check_alive(cluster)
        after = node_counters(cluster, (n.PREFIX + "prefix_cache", n.PREFIX + "kv_offload"))
    counters = {k: after[k] - base.get(k, 0.0) for k in after}
    return {"samples": samples, "counters": counters}


def counter(counters: dict, name: str, **labels: str) -> float:
    """Sum of the counter series called ``name`` whose labels include ``labels`` (node role prefill)."""
    total = 0.0
    for key, value in counters.items():
        metric, _, rest = key.partition("{")
        if metric != name or 'role="prefill"' not in rest:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def summarize(runs: list[dict]) -> dict:
    samples = [s for r in runs for s in r["samples"]]
    all_t = sorted(t for _, t in samples)
    later = sorted(t for turn, t in samples if turn > 1)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    counters: dict[str, float] = {}
    for r in runs:
        for k, v in r["counters"].items():
            counters[k] = counters.get(k, 0.0) + v
    queried = counter(counters, n.PREFIX_CACHE_QUERIES)
    hit = counter(counters, n.PREFIX_CACHE_HITS)  # device and lower tiers, tokens
    host = counter(counters, n.KV_OFFLOAD_HITS, tier="host") * BLOCK_SIZE
    return {
        "requests": len(samples),
        "ttft_p50_ms": round(statistics.median(all_t) * 1000, 1), "ttft_p99_ms": round(pct(all_t, 0.99) * 1000, 1),
        "ttft_p50_ms_turn2+": round(statistics.median(later) * 1000, 1),
        "ttft_p99_ms_turn2+": round(pct(later, 0.99) * 1000, 1),
        "prompt_tokens": int(queried),
        "served_from": {"device": int(hit - host), "host": int(host), "recomputed": int(queried - hit)},
        "hit_rate": {"device": round((hit - host) / queried, 3) if queried else 0.0,
                     "host": round(host / queried, 3) if queried else 0.0},
        "host_bytes": {"stored": int(counter(counters, n.KV_OFFLOAD_BYTES, tier="host",
                                             direction="store")),
                       "loaded": int(counter(counters, n.KV_OFFLOAD_BYTES, tier="host",
                                             direction="load"))},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--first", type=int, default=2000, help="tokens of a conversation's first prompt")
    ap.add_argument("--added", type=int, default=1200, help="tokens each later turn adds")
    ap.add_argument("--kv-cache-memory", default="384MiB", help="each node's device KV cache (one prompt)")
    ap.add_argument("--kv-offload-memory", default="3GiB", help="the host tier of the 'host tier' setup")
    ap.add_argument("--rounds", type=int, default=2, help="alternate the setups this many times")
    ap.add_argument("--out", default=str(RESULTS / "kv_tiers_cpu.json"))
    args = ap.parse_args()
    os.environ.setdefault("SPLITSERVE_QUIET", "1")
    runs: dict[str, list[dict]] = {s: [] for s in SETUPS}
    for rnd in range(args.rounds):
        convos = conversations(args.conversations, args.turns, args.first, args.added, seed=rnd)
        for name in SETUPS if rnd % 2 == 0 else reversed(SETUPS):
            print(f"round {rnd + 1}/{args.rounds}: {name}", flush=True)
            runs[name].append(run_setup(name, args, convos, seed=rnd))
    summary = {name: summarize(r) for name, r in runs.items()}
    base, tier = summary["device only"], summary["host tier"]
    summary["ratio_ttft_p50_device_only_over_host_tier"] = round(base["ttft_p50_ms"] / tier["ttft_p50_ms"], 2)
    summary["ratio_ttft_p99_device_only_over_host_tier"] = round(base["ttft_p99_ms"] / tier["ttft_p99_ms"], 2)
    summary["ratio_ttft_p50_turn2+"] = round(base["ttft_p50_ms_turn2+"] / tier["ttft_p50_ms_turn2+"], 2)
    summary["workload"] = {"conversations": args.conversations, "turns": args.turns, "first": args.first,
                           "added": args.added, "kv_cache_memory": args.kv_cache_memory,
                           "kv_offload_memory": args.kv_offload_memory, "rounds": args.rounds,
                           "model": MODEL, "machine": f"{os.cpu_count()} CPUs, one torch thread per node"}
    print(json.dumps(summary, indent=2))
    out = RESULTS / args.out if not os.path.isabs(args.out) else args.out
    with open(out, "w") as f:
        json.dump({"summary": summary, "samples_s": {k: [s for r in v for s in r["samples"]]
                                                    for k, v in runs.items()}}, f, indent=2)
    plot(runs, str(out).removesuffix(".json") + ".png")
    return 0


def plot(runs: dict[str, list[dict]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, marker in zip(SETUPS, "ox"):
        pts = [s for r in runs[name] for s in r["samples"]]
        ax.scatter([turn + (0.1 if marker == "x" else -0.1) for turn, _ in pts], [t for _, t in pts],
                   marker=marker, label=name)
    ax.set_xlabel("turn of the conversation")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("Multi-turn long context: TTFT with and without a host KV tier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
