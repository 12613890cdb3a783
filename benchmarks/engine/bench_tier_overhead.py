"""What does a host tier cost a decode node's engine thread per long prompt, on this CPU?
A simulated ``llama3-8b-h100`` engine (the profile's KV pool, the real block pool, prefix
cache, scheduler and tiers; the forward is a sleep shrunk to nothing) takes 15k-token
prompts as a decode node does: ``reserve`` (blocks for the prompt, evicting cached ones),
``add_prefilled`` (admission) and its decode steps (where the blocks it completed are
written through to the host tier). With and without a host tier of the profile's size,
alternating, several rounds; after a warm-up that fills the pool and the host tier, so
evictions and host spills are part of every request.

    .venv/bin/python benchmarks/engine/bench_tier_overhead.py [--rounds 3] [--requests 60]

Prints the median per-request milliseconds of each stage and writes
``benchmarks/results/tier_overhead.json``. This is host time the modelled deployment's
CPU would spend too (the same Python runs there); a simulated node adds it to its steps.
"""

import argparse
import json
import statistics
import sys
import time

import torch

from splitserve.benchmarks.harness import RESULTS
from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.planner.sim_profiles import get_profile
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.sim_runner import standin_tiers

PROFILE = "llama3-8b-h100"
PROMPT_TOKENS = 15000
STAGES = ("reserve", "admit", "steps")


def engine(tier: bool) -> EngineCore:
    p = get_profile(PROFILE)
    return EngineCore(standin_tiers(EngineConfig(
        kv_cache_memory=p.kv_pool_bytes, block_size=p.block_size, kv_offload_memory=p.host_tier_bytes if tier else 0,
        sim=p.sim_config(speedup=1e6))))


def prompt(i: int) -> list[int]:
    return [(i * 7919 + j * 31) % 49000 + 1 for j in range(PROMPT_TOKENS)]


def serve(e: EngineCore, i: int) -> dict[str, float]:
    """One prompt as a decode node takes it; milliseconds per stage."""
    ids, rid = prompt(i), f"r{i}"
    t0 = time.perf_counter()
    ref = e.prompt_ref(ids)  # its hashes: computed by the reserve, kept for the admission (as on a node)
    res = e.reserve(rid, ref)
    assert res is not None, "the pool holds one prompt at least"
    t1 = time.perf_counter()
    e.add_prefilled(rid, ref, SamplingParams(max_tokens=4, ignore_eos=True), first_token=5, logprobs=None,
                    num_cached_tokens=res.num_cached_tokens)
    t2 = time.perf_counter()
    while e.has_unfinished():
        e.step()
    t3 = time.perf_counter()
    return {"reserve": (t1 - t0) * 1e3, "admit": (t2 - t1) * 1e3, "steps": (t3 - t2) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=60, help="timed per round and setup")
    ap.add_argument("--out", default=str(RESULTS / "tier_overhead.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    engines = {"none": engine(False), "host": engine(True)}
    blocks = engines["none"].num_blocks
    tiers = engines["host"].kv.tiers
    assert tiers is not None
    warm = (blocks + tiers.host_blocks) * 16 // PROMPT_TOKENS + 4  # the pool and the host tier full
    print(f"{PROFILE}: {blocks} device blocks, {PROMPT_TOKENS}-token prompts, warm-up {warm} each", flush=True)
    for e in engines.values():
        for i in range(warm):
            serve(e, i)
    samples: dict[str, dict[str, list[float]]] = {name: {s: [] for s in STAGES} for name in engines}
    start = warm
    for r in range(args.rounds):
        for name, e in engines.items():
            for i in range(start, start + args.requests):
                for stage, ms in serve(e, i).items():
                    samples[name][stage].append(ms)
        start += args.requests
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    result = {"profile": PROFILE, "prompt_tokens": PROMPT_TOKENS, "device_blocks": blocks,
              "requests": args.rounds * args.requests, "machine": "this CPU, one torch thread",
              "median_ms": {name: {s: round(statistics.median(v), 3) for s, v in st.items()}
                            for name, st in samples.items()}}
    med = result["median_ms"]
    result["extra_ms_with_host_tier"] = {s: round(med["host"][s] - med["none"][s], 3) for s in STAGES}
    for name in engines:
        print(f"{name:>5}: " + ", ".join(f"{s} {med[name][s]:.2f} ms" for s in STAGES))
    print("extra with a host tier: " + ", ".join(f"{s} {v:+.2f} ms" for s, v in result["extra_ms_with_host_tier"].items()))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
