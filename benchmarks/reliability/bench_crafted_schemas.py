"""Does one API key sending crafted structured-output schemas slow other keys down?

    .venv/bin/python -m splitserve.benchmarks.reliability.bench_crafted_schemas [--rounds 3]
        [--phase-s 40] [--rate 2.0] [--hostile 100] [--out FILE]

A local cluster (Redis, the router with three API keys, one colocated node serving the
bundled SmolLM2 on this machine's CPU: structured outputs need a real engine; with
``--pin``, the default, the node on CPU 0 and the router on the others). Two normal
keys each send ``--rate`` streamed chat requests a second (open loop; half of them with
a small JSON schema compiled once at warm-up), and the time to their first content token
(TTFT) is measured. Each round runs two phases of ``--phase-s`` seconds, in alternating
order:

  quiet    the two normal keys only
  hostile  the same, while a third key sends ``--hostile`` crafted schemas, spread over
           the phase (at most 8 in flight, 429s not retried):
           the costliest kinds the limits accept (common/grammar_limits.py), each one new
           so each would be a compile (two strings of distinct maxLength ~128, a pattern
           (.{0,64})+), and kinds the limits refuse (four strings of maxLength ~1e5, a
           nested (.{0,4}){16}: 6.6 s and 15 s of compile before them)

Reported: the normal keys' TTFT p50 / p99 over every round's samples of each phase and
the hostile / quiet p99 ratio (target: within 1.10), each round's figures, the hostile
key's answers by status (400: refused by the limits, 429: its compile budget, 200:
compiled and served), and the node's compiles by outcome. The run is marked not
sustained, and says why, when a normal request failed, the normal keys got less than
90% of their rate, or two halves of the quiet samples (even and odd rounds) put p99
more than 10% apart (a machine too busy, or a run too short, to resolve 10%).

Writes ``benchmarks/results/crafted_schemas.json`` (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import aiohttp

from splitserve.benchmarks.harness import MODEL, RESULTS, check_alive
from splitserve.common import metric_names as names
from splitserve.deploy.launcher import Cluster

KEYS = {"normal-a": "normal-key-a-0123456789", "normal-b": "normal-key-b-0123456789",
        "hostile": "hostile-key-0123456789"}
PROMPTS = ["Name a city and its population.", "What is the capital of France?", "Describe a cat in JSON.",
           "List three colors.", "Give a person's name and age."]
SMALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def crafted(i: int) -> dict:
    """The hostile key's i-th schema: new each time, accepted or refused by the limits."""
    kind = i % 4
    if kind == 0:  # accepted: two distinct length bounds at the budget (3-4 s of one core each)
        return {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "string", "minLength": i % 97, "maxLength": 128},
            "b": {"type": "string", "minLength": 1 + i % 89, "maxLength": 127}}}
    if kind == 1:  # accepted: a pattern of 256 mask positions (about 5 s)
        return {"type": "string", "pattern": f"^{i}(.{{0,64}})+$"}
    if kind == 2:  # refused: the four strings of maxLength ~1e5
        return {"type": "object", "properties": {f"k{j}": {"type": "string", "maxLength": 99_990 + i + j}
                                                  for j in range(4)}}
    return {"type": "string", "pattern": f"^{i}(.{{0,4}}){{16}}$"}  # refused: nested, 15 s before


class Sample(NamedTuple):
    key: str
    ok: bool
    status: int
    ttft_s: float | None  # the first content token, from the send


async def chat(session: aiohttp.ClientSession, url: str, key: str, prompt: str, schema: dict | None,
               max_tokens: int) -> Sample:
    body: dict = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                  "temperature": 0, "stream": True}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    t0 = time.monotonic()
    ttft = None
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {KEYS[key]}"},
                                timeout=aiohttp.ClientTimeout(total=180)) as r:
            if r.status != 200:
                await r.read()
                return Sample(key, False, r.status, None)
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Sample(key, False, 200, ttft)
                if ttft is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    ttft = time.monotonic() - t0
        return Sample(key, ttft is not None, 200, ttft)
    except (aiohttp.ClientError, TimeoutError) as e:
        print(f"  {key}: {e!r}")
        return Sample(key, False, 0, None)


async def normal_load(url: str, key: str, rate: float, duration_s: float, seed: int) -> list[Sample]:
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.monotonic()
        i = 0
        while time.monotonic() < t0 + duration_s:
            schema = SMALL_SCHEMA if (i + seed) % 2 else None
            tasks.append(asyncio.create_task(chat(s, url, key, PROMPTS[(i + seed) % len(PROMPTS)], schema, 16)))
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        return list(await asyncio.gather(*tasks))


async def hostile_load(url: str, count: int, start: int, duration_s: float) -> list[Sample]:
    """``count`` crafted schemas spread evenly over ``duration_s`` (at most 8 in flight):
    the key's compile budget is pressed the whole phase, not just its first seconds."""
    sem = asyncio.Semaphore(8)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(i: int) -> Sample:
            async with sem:
                return await chat(s, url, "hostile", PROMPTS[0], crafted(i), 4)
        tasks = []
        t0 = time.monotonic()
        for k in range(count):
            tasks.append(asyncio.create_task(one(start + k)))
            await asyncio.sleep(max(0.0, t0 + (k + 1) * duration_s / count - time.monotonic()))
        return list(await asyncio.gather(*tasks))


async def phase(url: str, hostile: bool, args, round_no: int) -> dict:
    h = asyncio.create_task(hostile_load(url, args.hostile, round_no * args.hostile, args.phase_s)) if hostile else None
    loads = await asyncio.gather(*(normal_load(url, k, args.rate, args.phase_s, seed)
                                   for seed, k in enumerate(("normal-a", "normal-b"))))
    hostile_samples = await h if h is not None else []
    normal = [x for load in loads for x in load]
    ttfts = sorted(x.ttft_s for x in normal if x.ok and x.ttft_s is not None)
    return {"hostile": hostile, "normal_sent": len(normal), "normal_failed": sum(not x.ok for x in normal),
            "normal_rate": len(normal) / args.phase_s / 2,
            "ttft_p50_s": _pct(ttfts, 0.50), "ttft_p99_s": _pct(ttfts, 0.99), "ttfts": ttfts,
            "hostile_status": dict(Counter(str(x.status) for x in hostile_samples))}


def _pct(xs: list[float], q: float) -> float:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else float("nan")


async def compile_outcomes(c: Cluster) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"{c.node('colocated-0').addr}/metrics",
                                                   headers=c.auth_headers()) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith(names.GRAMMAR_COMPILES + "{"):
            label = ln.split('outcome="', 1)[1].split('"', 1)[0]
            out[label] = out.get(label, 0.0) + float(ln.rsplit(" ", 1)[1])
    return out


async def run(c: Cluster, args) -> dict:
    async with aiohttp.ClientSession() as s:  # warm-up: the compile workers start, the small schema compiles
        for key in ("normal-a", "normal-b"):
            warm = await chat(s, c.url, key, PROMPTS[0], SMALL_SCHEMA, 4)
            assert warm.ok, f"warm-up failed: HTTP {warm.status}"
    rounds = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {}
        for hostile in order:
            got["hostile" if hostile else "quiet"] = res = await phase(c.url, hostile, args, r)
            print(f"round {r} {'hostile' if hostile else 'quiet  '}: TTFT p50 {res['ttft_p50_s']:.3f} s, "
                  f"p99 {res['ttft_p99_s']:.3f} s, {res['normal_sent']} sent, {res['normal_failed']} failed"
                  + (f", hostile answers {res['hostile_status']}" if hostile else ""), flush=True)
            check_alive(c)
            await asyncio.sleep(3)  # the hostile key's last compiles end before the next phase
        rounds.append(got)
    return {"rounds": rounds, "compiles": await compile_outcomes(c)}


def summarize(result: dict, args) -> dict:
    """Pooled over rounds: every quiet phase's TTFTs against every hostile phase's."""
    quiet = [r["quiet"] for r in result["rounds"]]
    hostile = [r["hostile"] for r in result["rounds"]]
    pooled = {name: sorted(t for x in rows for t in x["ttfts"]) for name, rows in (("quiet", quiet),
                                                                                  ("hostile", hostile))}
    q99, h99 = _pct(pooled["quiet"], 0.99), _pct(pooled["hostile"], 0.99)
    # how far apart two halves of the quiet samples (even and odd rounds) put p99: the noise
    halves = [sorted(t for x in quiet[k::2] for t in x["ttfts"]) for k in (0, 1)]
    noise = (max(_pct(halves[0], 0.99), _pct(halves[1], 0.99)) / min(_pct(halves[0], 0.99), _pct(halves[1], 0.99))
             if len(quiet) > 1 else float("nan"))
    problems = []
    for name, rows in (("quiet", quiet), ("hostile", hostile)):
        if any(x["normal_failed"] for x in rows):
            problems.append(f"{sum(x['normal_failed'] for x in rows)} normal requests failed in the {name} phases")
        if min(x["normal_rate"] for x in rows) < 0.9 * args.rate:
            problems.append(f"the normal keys got less than 90% of --rate {args.rate} in a {name} phase")
    if noise > 1.10:
        problems.append(f"two halves of the quiet samples put TTFT p99 {noise:.2f}x apart: this machine is too "
                        "busy (or the run too short) to resolve a 10% difference")
    statuses: Counter = Counter()
    for x in hostile:
        statuses.update(x["hostile_status"])
    med = lambda rows, k: round(statistics.median(x[k] for x in rows), 4)  # noqa: E731
    return {"quiet": {"ttft_p50_s": _pct(pooled["quiet"], 0.5), "ttft_p99_s": q99, "samples": len(pooled["quiet"]),
                      "round_p99_median_s": med(quiet, "ttft_p99_s")},
            "hostile": {"ttft_p50_s": _pct(pooled["hostile"], 0.5), "ttft_p99_s": h99,
                        "samples": len(pooled["hostile"]), "round_p99_median_s": med(hostile, "ttft_p99_s")},
            "p99_ratio": round(h99 / q99, 3), "p50_ratio": round(_pct(pooled["hostile"], 0.5)
                                                                 / _pct(pooled["quiet"], 0.5), 3),
            "target_ratio": 1.10, "quiet_p99_noise": round(noise, 3), "hostile_answers": dict(statuses),
            "node_compiles": result["compiles"], "sustained": not problems, "problems": problems}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phase-s", type=float, default=40.0)
    ap.add_argument("--rate", type=float, default=2.0, help="requests a second of each normal key")
    ap.add_argument("--hostile", type=int, default=100, help="crafted schemas per hostile phase")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="the node on CPU 0, the router on the others (default on)")
    ap.add_argument("--out", default=str(RESULTS / "crafted_schemas.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()
    cpus = os.cpu_count() or 1
    # the node (and so its compile workers and thread) on CPU 0, the router on the others: the
    # compiles compete with the engine under their niceness, not with the router and this client
    pins = {"colocated": (0,), "router": tuple(range(1, cpus))} if args.pin and cpus >= 2 else None
    with Cluster(prefill_nodes=0, decode_nodes=1, colocated=True, kv_cache_memory="256MiB",
                 api_keys=tuple(KEYS.values()), cpus=pins) as c:
        result = asyncio.run(run(c, args))
    summary = summarize(result, args)
    summary["load_avg_before"] = [round(x, 2) for x in load_before]
    print(f"normal keys' TTFT p99 (every round's samples): quiet {summary['quiet']['ttft_p99_s']:.3f} s, hostile "
          f"{summary['hostile']['ttft_p99_s']:.3f} s: {summary['p99_ratio']:.2f}x (target <= 1.10; quiet halves "
          f"{summary['quiet_p99_noise']:.2f}x apart); p50 {summary['quiet']['ttft_p50_s']:.3f} / "
          f"{summary['hostile']['ttft_p50_s']:.3f} s ({summary['p50_ratio']:.2f}x)")
    print(f"hostile key's answers: {summary['hostile_answers']}; node compiles: {summary['node_compiles']}")
    print("sustained" if summary["sustained"] else "NOT SUSTAINED: " + "; ".join(summary["problems"]))
    rounds = [{k: {f: v for f, v in x.items() if f != "ttfts"} for k, x in r.items()} for r in result["rounds"]]
    Path(args.out).write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), **summary,
                                          "rounds": rounds}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
