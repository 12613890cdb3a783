"""Does the router stay up, answer below 500 and keep serving normal clients under
fuzzed requests and a slowloris attack?

    .venv/bin/python benchmarks/reliability/bench_router_abuse.py [--fuzz 10000] [--slowloris 500]
        [--seconds 20]

Starts a real Redis, one simulated decode node (``splitserve sim-nodes``: the real
server, block pool and scheduler, a timing model for the forward pass) and the real
router (``--max-model-len 128`` so valid fuzz cases generate a few tokens), then:

1. Fuzz: ``--fuzz`` cases from openai_fuzz.py (hypothesis: wrong types, ints beyond
   64 bits, NaN literals, deep nesting, raw bytes, compressed bodies, odd headers, and
   valid bodies), sent 8 at a time. Counts answers by status, the
   5xx (target 0, first few kept), and node / router processes that died (target 0).
2. Slowloris: a closed loop of 4 clients sending short valid completions for
   ``--seconds`` with no attack, then again while ``--slowloris`` raw connections
   dribble header bytes (one every second, reconnecting whenever the router closes
   them). Reports the normal requests' success rate and latency p50/p99 in both
   phases, and how long the router let an attacking connection live (its header
   timeout, 10 s by default).

Writes ``benchmarks/results/router_abuse.json``.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import aiohttp

from splitserve.benchmarks.harness import RESULTS

MODEL = "SmolLM2-135M-Instruct"
NORMAL_BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}


def generate_cases(n: int) -> list:
    """``n`` fuzz cases drawn by hypothesis (generation only: nothing to shrink)."""
    from hypothesis import HealthCheck, Phase, given, settings

    from splitserve.benchmarks.reliability.openai_fuzz import fuzz_cases

    cases = []

    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=fuzz_cases())
    def collect(case):
        cases.append(case)

    collect()
    return cases


def run_fuzz(host: str, port: int, cases: list, workers: int = 8) -> dict:
    from splitserve.benchmarks.reliability.openai_fuzz import send

    def one(case):
        try:
            return send(host, port, case), case
        except OSError as e:  # no answer at all: counted apart from HTTP statuses
            return f"no answer: {type(e).__name__}", case

    statuses: Counter = Counter()
    five_xx: list[dict[str, object]] = []  # the first few failures, as sent
    t0 = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        for i, (status, case) in enumerate(pool.map(one, cases)):
            statuses[str(status)] += 1
            if not isinstance(status, int) or status >= 500:
                if len(five_xx) < 5:
                    five_xx.append({"status": status, "path": case.path, "headers": case.headers,
                                    "body": case.body[:300].decode("utf-8", "replace")})
            if (i + 1) % 1000 == 0:
                print(f"  fuzz: {i + 1}/{len(cases)} sent, {dict(statuses)}", file=sys.stderr)
    failed = sum(v for k, v in statuses.items() if not k.isdigit() or int(k) >= 500)
    return {"requests": len(cases), "seconds": round(time.monotonic() - t0, 1),
            "statuses": dict(sorted(statuses.items())), "5xx_or_no_answer": failed,
            "first_failures": five_xx}


async def normal_load(url: str, seconds: float, clients: int = 4) -> dict:
    """A closed loop of ``clients`` sending NORMAL_BODY for ``seconds``."""
    latencies: list[float] = []  # seconds, succeeded requests
    failures: Counter[str] = Counter()  # HTTP status or exception name -> requests
    deadline = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async def client():
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                try:
                    async with http.post(url + "/v1/completions", json=NORMAL_BODY) as resp:
                        await resp.read()
                        ok = resp.status == 200
                        if not ok:
                            failures[str(resp.status)] += 1
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    ok = False
                    failures[type(e).__name__] += 1
                if ok:
                    latencies.append(time.monotonic() - t0)

        await asyncio.gather(*(client() for _ in range(clients)))
    total = len(latencies) + sum(failures.values())
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [float("nan")] * 99
    return {"requests": total, "succeeded": len(latencies),
            "success_rate": round(len(latencies) / total, 4) if total else None,
            "failures": dict(failures), "latency_p50_ms": round(q[49] * 1000, 1),
            "latency_p99_ms": round(q[98] * 1000, 1)}


async def slowloris(host: str, port: int, connections: int, stop: asyncio.Event) -> dict:
    """``connections`` sockets sending one header byte a second; each reopens when the
    router closes it. Returns how many were opened and how long they lived."""
    lifetimes, opened, refused = [], 0, 0

    async def attacker(i: int):
        nonlocal opened, refused
        await asyncio.sleep(i * 0.002)  # ramp up over ~1 s
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                refused += 1
                await asyncio.sleep(0.5)
                continue
            opened += 1
            t0 = time.monotonic()
            try:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: victim\r\n")
                while not stop.is_set():
                    writer.write(b"X")
                    await writer.drain()
                    try:  # the router closing shows as EOF or a reset
                        if await asyncio.wait_for(reader.read(1024), 1.0) == b"":
                            break
                    except asyncio.TimeoutError:
                        pass
                else:
                    continue  # stopped by us: not a lifetime the router chose
                lifetimes.append(time.monotonic() - t0)
            except ConnectionError:
                lifetimes.append(time.monotonic() - t0)
            finally:
                writer.close()

    tasks = [asyncio.create_task(attacker(i)) for i in range(connections)]
    await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"connections": connections, "opened": opened, "connect_failures": refused,
            "closed_by_router": len(lifetimes),
            "lifetime_median_s": round(statistics.median(lifetimes), 2) if lifetimes else None}


async def attack_phase(url: str, connections: int, seconds: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    stop = asyncio.Event()
    attack = asyncio.create_task(slowloris(host, int(port), connections, stop))
    await asyncio.sleep(3)  # every attacking connection is open
    load = await normal_load(url, seconds)
    stop.set()
    return {"normal": load, "attack": await attack}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fuzz", type=int, default=10_000, help="fuzzed requests")
    p.add_argument("--slowloris", type=int, default=500, help="attacking connections")
    p.add_argument("--seconds", type=float, default=20.0, help="normal load per phase")
    args = p.parse_args()
    os.environ.setdefault("SPLITSERVE_QUIET", "1")
    from splitserve.deploy.launcher import SimCluster

    result: dict[str, object] = {"config": vars(args)}
    with SimCluster(0, 1, fleet_procs=1, sim_args=["--sim-speedup", "50"],
                    kv_cache_memory="256MiB", router_args=["--max-model-len", "128"]) as c:
        host, port = c.url.removeprefix("http://").split(":")
        t0 = time.monotonic()
        cases = generate_cases(args.fuzz)
        print(f"generated {len(cases)} fuzz cases in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        fuzz = run_fuzz(host, int(port), cases)
        fuzz["dead_processes"] = [p.name for p in c.procs if p.popen.poll() is not None]
        result["fuzz"] = fuzz
        print(json.dumps({"fuzz": fuzz}, indent=1))
        baseline = asyncio.run(normal_load(c.url, args.seconds))
        print(json.dumps({"no_attack": baseline}))
        attacked = asyncio.run(attack_phase(c.url, args.slowloris, args.seconds))
        print(json.dumps({"slowloris": attacked}))
        result["slowloris"] = {"no_attack": baseline, "under_attack": attacked["normal"],
                               "attack": attacked["attack"]}
        result["dead_processes_at_end"] = [p.name for p in c.procs if p.popen.poll() is not None]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "router_abuse.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS / 'router_abuse.json'}")
    ok = fuzz["5xx_or_no_answer"] == 0 and not result["dead_processes_at_end"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
