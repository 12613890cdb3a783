"""What does ``CacheAware.choose`` alone cost per request at 64 + 16 and 256 + 64 nodes?
(The "score" part of bench_router_cost.py, without Redis, hashing or a mirror.)

    .venv/bin/python benchmarks/router/bench_policy_cost.py [--nodes 64 256] [--seconds 3]

Steady state as a router sees it: every prefill node has recent work (decaying at
different ages), heartbeat loads are random (running, waiting, queued prompt tokens,
KV usage), this router has requests in flight on a few nodes, and a 100k-token prompt
is predicted cached on a handful of nodes (4 prefill nodes at random depths, 1 decode
node). Every call records its decision's work (the balance term's input), as in the
router, and gets a fresh list of the same node records (dispatch filters the live
nodes per request); "rebuild" times the first call after a heartbeat poll, when the
records are new and the policy rebuilds its per-node arrays (router/routing/node_terms.py).
Pinned to one core; p10/p50/p99 of wall time per call. Target:
p50 <= 0.15 ms at 256 + 64.
Writes ``benchmarks/results/policy_cost.json``.
"""

import argparse
import json
import os
import random
import statistics
import time
from collections import Counter

import msgspec

from splitserve.benchmarks.harness import RESULTS

PROMPT_TOKENS = 100_000


def fleet(prefills: int, rng: random.Random):
    from splitserve.common.load import NodeLoad
    from splitserve.common.node_registry import NodeInfo

    def node(nid, role, running, waiting, queued):
        return NodeInfo(node_id=nid, role=role, http_addr="http://127.0.0.1:1", model="m", epoch="e",
                        load=NodeLoad(running=running, waiting=waiting, queued_prefill_tokens=queued,
                                      kv_usage=rng.random()))

    nodes = [node(f"p{i}", "prefill", rng.randrange(4), rng.randrange(2), rng.randrange(20000))
             for i in range(prefills)]
    nodes += [node(f"d{i}", "decode", rng.randrange(32), rng.randrange(4), 0) for i in range(prefills // 4)]
    return nodes


def run(prefills: int, seconds: float, rng: random.Random) -> dict:
    from splitserve.router.routing.cache_aware import CacheAware

    nodes = fleet(prefills, rng)
    policy = CacheAware()
    now = time.monotonic()
    for n in nodes[:prefills]:  # steady state: recent work on every prefill node, of various ages
        for _ in range(3):
            policy.recent.merge(n.node_id, rng.uniform(1e4, 1e6), now - rng.uniform(0, 600))
    inflight = Counter({n.node_id: rng.randrange(1, 4) for n in rng.sample(nodes, 8)})
    inflight_tokens = Counter({nid: rng.randrange(1000, 100000) for nid in inflight})
    prompt = list(range(PROMPT_TOKENS))
    holders = rng.sample(nodes[:prefills], 4) + rng.sample(nodes[prefills:], 1)
    cached = {n.node_id: rng.randrange(0, PROMPT_TOKENS, 16) for n in holders}
    wall, cpu, calls = [], [], 0
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        live = list(nodes)
        c0, t0 = time.thread_time(), time.perf_counter()
        d = policy.choose(prompt, live, inflight, cached=cached, inflight_tokens=inflight_tokens,
                          tie_key=calls)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        assert d is not None and d.prefill is not None
        calls += 1
    rebuild = []
    for i in range(200):  # new records after each poll, with new loads
        polled = [msgspec.structs.replace(n, load=msgspec.structs.replace(n.load, waiting=i % 3))
                  for n in nodes]
        t0 = time.perf_counter()
        policy.choose(prompt, polled, inflight, cached=cached, inflight_tokens=inflight_tokens, tie_key=calls)
        rebuild.append(time.perf_counter() - t0)
    ms = lambda xs, q: round(sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] * 1000, 4)
    return {"prefill_nodes": prefills, "decode_nodes": prefills // 4, "calls": calls,
            "choose_p10_ms": ms(wall, 0.1), "choose_p50_ms": ms(wall, 0.5), "choose_p99_ms": ms(wall, 0.99),
            "choose_mean_ms": round(statistics.fmean(wall) * 1000, 4),
            "choose_cpu_mean_ms": round(statistics.fmean(cpu) * 1000, 4),
            "choose_after_poll_p50_ms": ms(rebuild, 0.5)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", default="policy_cost", help="results/<out>.json")
    args = ap.parse_args()
    os.sched_setaffinity(0, {0})
    load = round(os.getloadavg()[0], 2)  # before the runs, as the machine was
    runs = [run(p, args.seconds, random.Random(p)) for p in args.nodes]
    out = {"load_average_1m": load, "runs": runs}
    for r in runs:
        print(f"{r['prefill_nodes']} + {r['decode_nodes']} nodes: choose p10 {r['choose_p10_ms']} / "
              f"p50 {r['choose_p50_ms']} / p99 {r['choose_p99_ms']} ms ({r['calls']} calls), "
              f"first call after a poll p50 {r['choose_after_poll_p50_ms']} ms")
    print(f"load average {out['load_average_1m']}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
