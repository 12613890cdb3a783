"""Does a long prompt stall the router's other streams? Token gaps seen by streaming
clients while 100k-token chat prompts arrive, with the router preparing every body
on its event loop ("inline") against preparing large bodies on a worker thread (the
default, ``--prepare-thread-bytes``), in one run, setups alternated.

    .venv/bin/python benchmarks/router/bench_router_loop.py [--rounds 2] [--seconds 20]

Per setup: redis, the real router and one simulated prefill + decode node standing
for Llama-3-8B on an H100 (``--profile llama3-8b-h100``: 128k context, its roofline
step times); ``--streams`` clients each stream a short chat completion (``--tokens``
tokens) again and again, and one client sends a chat prompt of ~``--long-tokens``
tokens of text every ``--long-interval`` s with ``max_tokens`` the whole context: the
router renders and tokenizes it in full (~0.5 s of CPU for 100k tokens), then its
context check refuses it (400), so the nodes never see it and what the streams feel
is the router alone (a served long prompt adds the nodes' prefill, which is not what
this measures). Measured at the streaming clients: the gaps between consecutive
content chunks (p50 / p99 / max, and the share over 100 ms); and how long each long
request took to be answered. Writes
``benchmarks/results/router_loop.json`` and ``router_loop.png`` (the gap CDFs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import aiohttp

from splitserve.benchmarks.harness import RESULTS

PROFILE = "llama3-8b-h100"
INLINE = 1 << 30  # --prepare-thread-bytes beyond any body: every body prepared on the loop
SETUPS = {"inline": INLINE, "thread": None}  # None: the router's default
CONTEXT = 131072  # the profile's context: max_tokens this large never fits with a prompt
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
         "judge boxing matches near old river banks").split()


def long_text(tokens: int, rng: random.Random) -> str:
    """About ``tokens`` tokens of text (one word each, mostly)."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


async def stream_once(session: aiohttp.ClientSession, url: str, model: str, tokens: int,
                      gaps: list[float]) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        last = None
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"] or not chunk["choices"][0]["delta"].get("content"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now


async def streamer(session, url, model, tokens, gaps, stop: float) -> None:
    while time.perf_counter() < stop:
        await stream_once(session, url, model, tokens, gaps)


async def long_request(session, url, body: dict, latencies: list[float], outcomes: list[str]) -> None:
    t0 = time.perf_counter()
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        payload = await resp.json()
        latencies.append(time.perf_counter() - t0)
        # the context check refuses it, after the router rendered and tokenized it all
        ok = resp.status == 400 and payload["error"]["param"] == "max_tokens"
        outcomes.append("refused after tokenizing" if ok else f"{resp.status}: {str(payload)[:200]}")


async def long_sender(session, url, model, text: str, interval: float, stop: float,
                      latencies: list[float], outcomes: list[str]) -> None:
    """One long chat prompt every ``interval`` s, each sent without waiting for the last.
    ``max_tokens`` is the whole context, so the router prepares the prompt in full
    (render, tokenize, validate) and then refuses it: the nodes never see it, and the
    streams measure the router alone."""
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": CONTEXT}
    sent = []
    while time.perf_counter() < stop:
        sent.append(asyncio.create_task(long_request(session, url, body, latencies, outcomes)))
        await asyncio.sleep(interval)
    await asyncio.gather(*sent)


async def loop_lag(session: aiohttp.ClientSession, url: str) -> dict[float, float]:
    """The router's event-loop lag histogram: bucket upper bound (s) -> samples at or under it."""
    from prometheus_client.parser import text_string_to_metric_families

    from splitserve.common.metric_names import ROUTER_EVENT_LOOP_LAG

    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {float(s.labels["le"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == ROUTER_EVENT_LOOP_LAG + "_bucket"}


async def measure(url: str, model: str, args, text: str) -> dict:
    gaps: list[float] = []
    latencies: list[float] = []
    outcomes: list[str] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await stream_once(session, url, model, 4, [])  # warm: connections, first compile
        before = await loop_lag(session, url)
        stop = time.perf_counter() + args.seconds
        await asyncio.gather(
            *(streamer(session, url, model, args.tokens, gaps, stop) for _ in range(args.streams)),
            long_sender(session, url, model, text, args.long_interval, stop, latencies, outcomes))
        after = await loop_lag(session, url)
    lag = {le: after[le] - before.get(le, 0.0) for le in after}  # the load's samples only
    total = lag.get(float("inf"), 0.0)
    gaps.sort()
    q = lambda xs, p: round(xs[min(len(xs) - 1, int(len(xs) * p))] * 1000, 1) if xs else None
    return {"loop_lag_samples": int(total),
            "loop_lag_over_100ms": int(total - lag.get(0.1, 0.0)),
            "loop_lag_p99_le_s": next((le for le in sorted(lag) if lag[le] >= 0.99 * total), None),
            "gaps": len(gaps), "gap_p50_ms": q(gaps, 0.5), "gap_p99_ms": q(gaps, 0.99),
            "gap_max_ms": q(gaps, 1.0), "gaps_over_100ms": sum(g > 0.1 for g in gaps),
            "share_over_100ms": round(sum(g > 0.1 for g in gaps) / max(1, len(gaps)), 4),
            "long_requests": len(outcomes),
            "long_unexpected": [o for o in outcomes if o != "refused after tokenizing"],
            "long_latency_p50_s": round(sorted(latencies)[len(latencies) // 2], 3) if latencies else None,
            "_gaps_ms": [round(g * 1000, 2) for g in gaps]}


def run_setup(name: str, args, text: str) -> dict:
    from splitserve.common.bundled import BUNDLED_MODEL_ID
    from splitserve.deploy.planner.sim_profiles import get_profile
    from splitserve.deploy.launcher import SimCluster

    router_args = ["--max-model-len", str(get_profile(PROFILE).context), "--allow-long-max-model-len"]
    if SETUPS[name] is not None:
        router_args += ["--prepare-thread-bytes", str(SETUPS[name])]
    with SimCluster(1, 1, fleet_procs=1, sim_args=["--profile", PROFILE],
                    router_args=router_args) as cluster:
        return asyncio.run(measure(cluster.url, BUNDLED_MODEL_ID, args, text))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="each setup this many times, alternated")
    ap.add_argument("--seconds", type=float, default=20.0, help="of load per setup and round")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200, help="per streamed completion")
    ap.add_argument("--long-tokens", type=int, default=100_000)
    ap.add_argument("--long-interval", type=float, default=2.0, help="s between long prompts")
    ap.add_argument("--out", default=str(RESULTS / "router_loop.json"))
    args = ap.parse_args()
    text = long_text(args.long_tokens, random.Random(0))
    runs: dict[str, list[dict]] = {name: [] for name in SETUPS}
    for r in range(args.rounds):
        for name in (SETUPS if r % 2 == 0 else reversed(list(SETUPS))):
            print(f"[router-loop] round {r + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
            res = run_setup(name, args, text)
            runs[name].append(res)
            print(json.dumps({"setup": name, "round": r + 1,
                              **{k: v for k, v in res.items() if not k.startswith("_")}}), flush=True)
    summary = {}
    for name, rs in runs.items():
        gaps = sorted(g for r in rs for g in r["_gaps_ms"])
        summary[name] = {"gaps": len(gaps), "gap_p50_ms": gaps[len(gaps) // 2],
                         "gap_p99_ms": gaps[int(len(gaps) * 0.99)], "gap_max_ms": gaps[-1],
                         "share_over_100ms": round(sum(g > 100 for g in gaps) / len(gaps), 4),
                         "long_requests": sum(r["long_requests"] for r in rs),
                         "long_unexpected": sum(len(r["long_unexpected"]) for r in rs),
                         "long_latency_p50_s": [r["long_latency_p50_s"] for r in rs]}
        print(f"{name:>7}: gap p50 {summary[name]['gap_p50_ms']} ms, p99 {summary[name]['gap_p99_ms']} ms, "
              f"max {summary[name]['gap_max_ms']} ms, over 100 ms {summary[name]['share_over_100ms']:.2%}; "
              f"{summary[name]['long_requests']} long prompts ({summary[name]['long_unexpected']} not refused "
              f"as expected), each answered in {summary[name]['long_latency_p50_s']} s (p50 per round)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"summary": summary, "profile": PROFILE, "args": vars(args), "load_average": os.getloadavg(),
              "runs": {n: [{k: v for k, v in r.items() if not k.startswith("_")} for r in rs]
                       for n, rs in runs.items()}}
    out.write_text(json.dumps(result, indent=1))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in runs:
        gaps = sorted(g for r in runs[name] for g in r["_gaps_ms"])
        ax.plot(gaps, [i / len(gaps) for i in range(len(gaps))], label=f"{name} (max {gaps[-1]:.0f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("gap between a stream's tokens, ms")
    ax.set_ylabel("share of gaps below")
    ax.set_title(f"streams while {args.long_tokens // 1000}k-token prompts arrive")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
