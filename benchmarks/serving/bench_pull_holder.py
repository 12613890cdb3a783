"""What do concurrent pulls of a hot prefix cost their holder's running batch? (issue 53)

    .venv/bin/python benchmarks/serving/bench_pull_holder.py            # ~9 min (3 rounds)
    .venv/bin/python benchmarks/serving/bench_pull_holder.py --quick    # a short smoke run

One decode node (the bundled model, its own process, one torch thread) holds a
``--prefix-tokens`` prefix and runs ``--streams`` long decodes: its running batch. From this
process, pullers (each the receiving half of a puller: a real KV receiver and transfer table
over a scratch pool, harness.py ``PullSink``, with no engine to cache what it gets, so every
pull moves the whole prefix) pull that prefix from it over tcp, again and again, during
windows of ``--window`` seconds. Arms, their order turning each of ``--rounds`` rounds:

    none     no pull: the batch's own step
    1        one pull at a time
    8        ``--pullers`` (8) pulls at a time: the holder's budget is shared, so this costs
             the batch what one pull can, at most PULL_STEP_SHARE of a step (node/pull_budget.py)

Reported per arm, pooled over the rounds: the holder's step as its streams see it (the gaps
between a stream's tokens, p50 and mean: a step plus whatever ran between two steps, the
pulls' copies included), its growth over ``none``'s and that growth over the stated budget
(PULL_STEP_SHARE; 1.0 is the budget spent), the engine's own time per step (its forward:
when that grows too, the step is slower because the CPU is shared, not because of what runs
between steps), the share of the window the holder's engine spent copying blocks out for
pulls (its ``kv_pull_copy_seconds_total``: what the budget governs), and the pulls and
blocks it served per second. The budget governs the engine thread; the holder's sends
(checksums, socket writes on its event loop, which shares the process's GIL) and the
pullers' receiving here are not in it, and show as growth beyond the copy share: run on a
machine with a core for each process (holder, this one) to tell them apart. The run is sustained when every pull landed whole and
``none``'s step moved by at most SPREAD_LIMIT between rounds; otherwise it says so and
prints no figures. Writes benchmarks/results/pull_holder_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request

import aiohttp
import msgspec

from splitserve.benchmarks.harness import RESULTS, PullSink
from splitserve.common import metric_names as names
from splitserve.common.kv_compat import KVCompat
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.protocol import GenerateRequest
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.launcher import Cluster
from splitserve.node.pull_budget import PULL_STEP_SHARE
from splitserve.router.streams.node_client import NodeClient

SPREAD_LIMIT = 1.15  # none's step p50 over the rounds, max / min, beyond which the machine did not sustain the run
FORWARD_NOTE = 0.05  # an arm's forward this much slower than none's: the report says the CPU is shared
BS = 16


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def copy_seconds(addr: str) -> float:
    """The holder's kv_pull_copy_seconds_total."""
    with urllib.request.urlopen(f"{addr}/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(names.KV_PULL_COPY_SECONDS))


class Streams:
    """The holder's running batch: ``n`` decodes, restarted when one ends, their phases
    staggered (stream i's first run is (i+1)/n of ``max_tokens``), so the batch's context, and
    with it the step, stays level over the run rather than growing with it; the arrival time of
    each of their tokens (monotonic s), per stream."""

    def __init__(self, addr: str, n: int, max_tokens: int):
        self.addr, self.n, self.max_tokens = addr, n, max_tokens
        self.times: list[list[float]] = []  # one list per stream run
        self.tasks: list[asyncio.Task] = []

    async def _one(self, session: aiohttp.ClientSession, i: int) -> None:
        run = 0
        while True:
            prompt = [(13 * i + 7 * j + 31 * run + 5) % 40000 + 100 for j in range(32)]
            tokens = self.max_tokens * (i + 1) // self.n if run == 0 else self.max_tokens
            req = GenerateRequest(request_id=f"batch-{i}-{run}", prompt=WirePrompt.of(prompt),
                                  sampling_params=SamplingParams(max_tokens=tokens, temperature=0,
                                                                 ignore_eos=True))
            times: list[float] = []
            self.times.append(times)
            stream = await NodeClient(session, read_timeout_s=60).generate(self.addr, req)
            try:
                async for delta in stream.deltas():
                    times.extend([time.monotonic()] * len(delta.token_ids))
            finally:
                stream.close()
            run += 1

    def start(self, session: aiohttp.ClientSession) -> None:
        self.tasks = [asyncio.create_task(self._one(session, i)) for i in range(self.n)]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def gaps(self, t0: float, t1: float) -> list[float]:
        """Seconds between consecutive tokens of a stream, both in [t0, t1]."""
        return [b - a for times in self.times for a, b in zip(times, times[1:]) if t0 <= a and b <= t1]


async def arm(sink: PullSink, session: aiohttp.ClientSession, addr: str, prefix: list[int], pullers: int,
              window_s: float, streams: Streams) -> dict:
    """One window with ``pullers`` pulls at a time: the batch's gaps, the holder's copy seconds, pulls."""
    blocks = len(prefix) // BS
    done, failed = [0, 0], []

    async def loop(k: int) -> None:
        dest = list(range(k * blocks, (k + 1) * blocks))
        while True:
            try:
                got = await sink.pull(session, addr, prefix, dest)
            except (RuntimeError, TimeoutError, aiohttp.ClientError) as e:
                failed.append(repr(e)[:200])
                continue
            if got != blocks:
                failed.append(f"{got} of {blocks} blocks")
            done[0] += 1
            done[1] += got

    copy0, engine0 = copy_seconds(addr), get_json(f"{addr}/debug/state")
    t0 = time.monotonic()
    loops = [asyncio.create_task(loop(k)) for k in range(pullers)]
    await asyncio.sleep(window_s)
    t1 = time.monotonic()
    copy1, engine1 = copy_seconds(addr), get_json(f"{addr}/debug/state")
    pulls, served = done[0], done[1]
    for t in loops:  # a pull cut here counts nowhere; the holder lets it go (the puller hung up)
        t.cancel()
    await asyncio.gather(*loops, return_exceptions=True)
    await asyncio.sleep(1.0)  # the holder lets the cut pulls go before the next window
    return {"gaps": streams.gaps(t0, t1), "copy_s": copy1 - copy0, "window_s": t1 - t0, "pulls": pulls,
            "blocks": served, "failed": failed, "forward_s": engine1["busy_s"] - engine0["busy_s"],
            "forwards": engine1["steps"] - engine0["steps"]}


def summarize(windows: dict[str, list[dict]]) -> dict:
    """Per arm, pooled over its windows (the module docstring's figures); ``none`` first."""
    out: dict = {}
    for name, ws in windows.items():
        gaps = [g for w in ws for g in w["gaps"]]
        secs = sum(w["window_s"] for w in ws)
        out[name] = {"step_p50_ms": 1e3 * statistics.median(gaps) if gaps else None,
                     "step_mean_ms": 1e3 * statistics.fmean(gaps) if gaps else None,
                     "steps": len(gaps), "copy_share": sum(w["copy_s"] for w in ws) / secs,
                     # the engine's own time per step (its forward, as busy_s counts it): a longer one
                     # means a slower forward (the CPU shared), not more between the steps
                     "forward_ms": 1e3 * sum(w["forward_s"] for w in ws) / max(1, sum(w["forwards"] for w in ws)),
                     "pulls_per_s": sum(w["pulls"] for w in ws) / secs,
                     "blocks_per_s": sum(w["blocks"] for w in ws) / secs,
                     "failed": [f for w in ws for f in w["failed"]],
                     "round_step_p50_ms": [1e3 * statistics.median(w["gaps"]) if w["gaps"] else None for w in ws]}
    base = out.get("none", {}).get("step_mean_ms")
    for name, r in out.items():
        if base and r["step_mean_ms"] is not None:
            r["growth"] = r["step_mean_ms"] / base - 1
            r["growth_over_budget"] = r["growth"] / PULL_STEP_SHARE
    return out


def sustained(summary: dict) -> tuple[bool, list[str]]:
    why = [f"{name}: {len(r['failed'])} pulls failed ({r['failed'][0]})" for name, r in summary.items() if r["failed"]]
    rounds = [p for p in summary.get("none", {}).get("round_step_p50_ms", []) if p]
    if len(rounds) > 1 and max(rounds) / min(rounds) > SPREAD_LIMIT:
        why.append(f"none's step p50 moved {max(rounds) / min(rounds):.2f}x between rounds (limit {SPREAD_LIMIT}): "
                   "the machine is busy")
    if any(r["steps"] == 0 for r in summary.values()):
        why.append("an arm saw no step of the holder's batch")
    return not why, why


async def measure(args, addr: str) -> dict:
    kv = msgspec.convert(get_json(f"{addr}/debug/state")["kv"], KVCompat)
    prefix = [(37 * j + 11) % 40000 + 100 for j in range(args.prefix_tokens)]
    arms = {"none": 0, "1": 1, str(args.pullers): args.pullers}
    windows: dict[str, list[dict]] = {name: [] for name in arms}
    sink = PullSink(kv, args.pullers * (len(prefix) // BS))
    await sink.start()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        warm = GenerateRequest(request_id="warm", prompt=WirePrompt.of(prefix + [7]),
                               sampling_params=SamplingParams(max_tokens=1, temperature=0))
        stream = await NodeClient(session, read_timeout_s=600).generate(addr, warm)
        [d async for d in stream.deltas()]  # the holder caches the prefix
        stream.close()
        streams = Streams(addr, args.streams, args.max_tokens)
        streams.start(session)
        await asyncio.sleep(args.settle)
        order = list(arms)
        try:
            for r in range(args.rounds):
                for name in order[r % len(order):] + order[:r % len(order)]:
                    w = await arm(sink, session, addr, prefix, arms[name], args.window, streams)
                    windows[name].append(w)
                    print(f"round {r + 1} {name:>4s}: step p50 "
                          f"{1e3 * statistics.median(w['gaps']) if w['gaps'] else float('nan'):.1f} ms, "
                          f"{w['pulls']} pulls, copy {w['copy_s'] / w['window_s']:.1%} of the window", flush=True)
        finally:
            await streams.stop()
            await sink.stop()
    return windows


def report(result: dict) -> None:
    if not result["sustained"]:
        print("NOT SUSTAINED: " + "; ".join(result["why"]) + "\nno figures")
        return
    print(f"\n{'arm':>5s} {'step p50':>9s} {'mean':>8s} {'growth':>7s} {'/budget':>8s} {'forward':>8s} "
          f"{'copy share':>11s} {'pulls/s':>8s} {'blocks/s':>9s}")
    for name, r in result["arms"].items():
        print(f"{name:>5s} {r['step_p50_ms']:8.1f}m {r['step_mean_ms']:7.1f}m {r.get('growth', 0):7.1%} "
              f"{r.get('growth_over_budget', 0):8.2f} {r['forward_ms']:7.1f}m {r['copy_share']:11.1%} "
              f"{r['pulls_per_s']:8.2f} {r['blocks_per_s']:9.0f}")
    print(f"(budget: the pulls' copies take at most {PULL_STEP_SHARE:.0%} of the holder's step; growth over budget "
          "1.0 = spent)")
    base = result["arms"].get("none", {}).get("forward_ms")
    slowed = {name: r["forward_ms"] / base - 1 for name, r in result["arms"].items()
              if base and r["forward_ms"] / base - 1 > FORWARD_NOTE}
    if slowed:
        print("note: the holder's forward itself slowed with pulls (" + ", ".join(
            f"{name}: +{g:.0%}" for name, g in slowed.items()) + "): its CPU is shared with the sends or the "
              "pullers, which the budget does not govern (pin them apart: --holder-cpus, --bench-cpus)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the holder's model folder (default: the bundled model)")
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--streams", type=int, default=4, help="the holder's running decodes")
    ap.add_argument("--max-tokens", type=int, default=400,
                    help="of each running decode (restarted when done: its context cycles, well within a window)")
    ap.add_argument("--pullers", type=int, default=8)
    ap.add_argument("--window", type=float, default=45.0, help="seconds of each arm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=10.0, help="seconds of the batch alone before the first window")
    ap.add_argument("--kv-cache-memory", default="1GiB", help="the holder's pool")
    ap.add_argument("--holder-cpus", type=int, nargs="+", default=None, metavar="CPU",
                    help="pin the holder process to these CPUs (one torch thread each), e.g. 0")
    ap.add_argument("--bench-cpus", type=int, nargs="+", default=None, metavar="CPU",
                    help="pin this process (the pullers, the batch's client) to these CPUs, e.g. 1")
    ap.add_argument("--quick", action="store_true", help="a short smoke run: 512 tokens, 2 streams, 2 pullers, 1 round")
    ap.add_argument("--out", default=str(RESULTS / "pull_holder_cpu.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.prefix_tokens, args.streams, args.pullers = 512, 2, 2
        args.window, args.rounds, args.settle, args.max_tokens = 4.0, 1, 2.0, 400
    if args.prefix_tokens % BS:
        raise ValueError(f"--prefix-tokens: a multiple of {BS}, got {args.prefix_tokens}")
    if args.bench_cpus:
        os.sched_setaffinity(0, args.bench_cpus)
    cluster = Cluster(prefill_nodes=0, decode_nodes=0, kv_backend="tcp", kv_cache_memory=args.kv_cache_memory,
                      model=args.model, cpus={"decode": args.holder_cpus} if args.holder_cpus else None)
    t_start = time.time()
    try:
        cluster.start_redis()
        holder = cluster.start_node("decode", 0)
        cluster.wait_ready(holder, 180)
        load_before = os.getloadavg()
        windows = asyncio.run(measure(args, cluster.node("decode-0").addr))
    finally:
        cluster.stop()
    summary = summarize(windows)
    ok, why = sustained(summary)
    result = {"arms": summary, "sustained": ok, "why": why, "pull_step_share": PULL_STEP_SHARE,
              "load_average_before": load_before, "args": vars(args), "started": t_start,
              "command": "benchmarks/serving/bench_pull_holder.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    report(result)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
