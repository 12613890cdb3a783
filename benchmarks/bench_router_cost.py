"""What one routing decision costs the router, with 64 prefill + 16 decode nodes.

    .venv/bin/python benchmarks/bench_router_cost.py [--seconds 10] [--concurrency 1 8 32]

Starts a real Redis and 80 simulated nodes (``splitserve sim-nodes``: real
registration, real prefix-index writes), warms their caches by replaying the
start of a generated 64-node trace through a real router, then, in this process
pinned to one core, runs the router's own decision path on the trace's prompts as
fast as it goes: parse the OpenAI body (``prepare_completion``) -> chained block
hashes and the prefix-index lookup in Redis (``PrefixIndex.lookup``, one Lua round
trip over the 80 nodes' sets) -> the ``cache_aware`` policy over the node list the
``NodeDirectory`` read from the registry. The HTTP server and the token streaming
around it are left out: they are the same for every policy.

Reports decision latency (lookup + scoring, as the router's histogram measures it)
at p50/p99 and decisions per second, at 1, 8 and 32 decisions in flight. Targets
(issue 4): p99 <= 2 ms, >= 1000 decisions/s on one core. Writes
``benchmarks/results/router_cost.json`` and ``router_cost.png``.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


async def decide_loop(prompts, seconds: float, concurrency: int, redis_url: str) -> dict:
    from splitserve.common.bundled import BUNDLED_MODEL_ID
    from splitserve.common.kv_index import KVIndex
    from splitserve.common.registry import NodeRegistry
    from splitserve.router.cache_aware import CacheAware
    from splitserve.router.config import RouterConfig
    from splitserve.router.discovery import NodeDirectory
    from splitserve.router.metrics import RouterMetrics
    from splitserve.router.prefix_index import PrefixIndex
    from splitserve.router.prepare import prepare_completion
    from splitserve.router.tokenizer import RouterTokenizer

    config = RouterConfig(redis_url=redis_url)
    metrics = RouterMetrics.create("bench-model")
    tok = RouterTokenizer(config.resolved_model_dir, config.max_model_len)
    registry = NodeRegistry(redis_url)
    directory = NodeDirectory(registry, config.model_id, metrics)
    await directory.refresh()
    index = KVIndex(redis_url, timeout_s=config.index_timeout_s)
    prefix = PrefixIndex(index, metrics, config.model_id, config.block_size)
    policy = CacheAware(config.weights)
    bodies = [json.dumps({"model": BUNDLED_MODEL_ID, "prompt": p, "max_tokens": 16}).encode() for p in prompts]
    latencies, hits, done = [], 0, 0
    stop_at = time.perf_counter() + seconds

    async def worker(k: int):
        nonlocal hits, done
        i = k
        while time.perf_counter() < stop_at:
            prep = prepare_completion(bodies[i % len(bodies)], tok, (BUNDLED_MODEL_ID,))
            t0 = time.perf_counter()
            nodes = directory.live()
            found = await prefix.lookup(prep.prompts[0], nodes)
            decision = policy.choose(prep.prompts[0], nodes, cached=found.cached)
            latencies.append(time.perf_counter() - t0)
            hits += bool(found.cached.get(decision.prefill.node_id))
            done += 1
            i += concurrency

    start = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    wall = time.perf_counter() - start
    await index.close()
    await registry.close()
    lat = sorted(latencies)
    return {"concurrency": concurrency, "decisions": done, "decisions_per_s": round(done / wall, 1),
            "latency_p50_ms": round(lat[len(lat) // 2] * 1000, 3),
            "latency_p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 3),
            "latency_mean_ms": round(statistics.fmean(lat) * 1000, 3),
            "nodes_seen": len(directory.live()), "decisions_with_a_hit": round(hits / max(1, done), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="per concurrency level")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--warm-requests", type=int, default=400)
    args = ap.parse_args()

    from splitserve.benchmarks.replay.generate import TraceSpec, generate
    from splitserve.benchmarks.replay.run import replay
    from splitserve.benchmarks.replay.trace import prompt_tokens
    from splitserve.common.bundled import BUNDLED_MODEL_ID
    from splitserve.deploy.launcher import SimCluster

    trace = generate(TraceSpec(rate=1.0))
    warm, probe = trace[:args.warm_requests], trace[args.warm_requests:args.warm_requests + 500]
    cluster = SimCluster(64, 16, fleet_procs=2, sim_args=["--sim-speedup", "50"], kv_cache_memory="4GiB")
    print("[router-cost] starting redis and 64 + 16 simulated nodes ...", file=sys.stderr, flush=True)
    with cluster:
        asyncio.run(replay(warm, cluster.url, BUNDLED_MODEL_ID, 50.0, 4))
        os.sched_setaffinity(0, {0})  # this process on one core; nodes and Redis on the rest
        prompts = [prompt_tokens(r) for r in probe]
        rows = []
        for c in args.concurrency:
            row = asyncio.run(decide_loop(prompts, args.seconds, c, cluster.redis_url))
            rows.append(row)
            print(f"[router-cost] {c:3d} in flight: {row['decisions_per_s']:7.1f} decisions/s, "
                  f"p50 {row['latency_p50_ms']:.3f} ms, p99 {row['latency_p99_ms']:.3f} ms "
                  f"({row['nodes_seen']} nodes, {row['decisions_with_a_hit']:.0%} with a hit)", flush=True)
    result = {"nodes": {"prefill": 64, "decode": 16}, "mean_prompt_tokens": round(
        statistics.fmean(len(p) for p in prompts)), "rows": rows,
        "targets": {"p99_ms_max": 2.0, "decisions_per_s_min": 1000}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "router_cost.json").write_text(json.dumps(result, indent=1))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    xs = [str(r["concurrency"]) for r in rows]
    a.bar(xs, [r["decisions_per_s"] for r in rows])
    a.axhline(1000, ls="--", color="r", lw=1)
    a.set_title("decisions / s on one core")
    a.set_xlabel("decisions in flight")
    b.bar(xs, [r["latency_p99_ms"] for r in rows], label="p99")
    b.bar(xs, [r["latency_p50_ms"] for r in rows], label="p50")
    b.axhline(2.0, ls="--", color="r", lw=1)
    b.set_title("decision latency, ms (64 + 16 nodes)")
    b.set_xlabel("decisions in flight")
    b.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "router_cost.png", dpi=110)
    print(f"wrote {RESULTS / 'router_cost.json'} and router_cost.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
