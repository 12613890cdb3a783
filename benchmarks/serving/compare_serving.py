"""Does 1 prefill + 1 decode node keep decode TPOT steady under long prompts better than
a colocated node on the same CPUs, and how does its throughput compare with
llama-cpp-python's server? Every setup in one run, through the load generator's library
(``splitserve.benchmarks.loadgen.bench``), same workloads:

    setup            CPU 0                         CPU 1
    1p1d             prefill node (1 thread),      decode node (1 thread)
                     router, redis, load generator
    colocated-2cpu   one colocated node on both CPUs (2 threads); router, redis and
                     the load generator on CPU 0 too: the same hardware as 1p1d
    colocated-1cpu   router, redis, load generator colocated node (1 thread): the same
                                                   compute per decode step as 1p1d
    llama-cpp        llama-cpp-python's OpenAI server on the same GGUF (Q4_1), both
                     CPUs, 2 threads; skipped with a message when its venv is absent
                     (baselines.py)

Workloads:
    mixed       ``--short`` short prompts decoding as a closed loop of ``--short-concurrency``
                streams while ``--long`` long prompts arrive every ``--long-interval`` s
                (splitserve setups only). Decode TPOT p99 of the short requests and TTFT
                p50 of all requests, per setup.
    throughput  ``--tput-requests`` requests as 32 concurrent streams (closed loop), output
                lengths spread +-50% around ``--tput-output``: output tokens/s, against
                llama-cpp-python, or without it transformers ``generate`` static batches of
                32 on the same prompts, measured in this run.

    python benchmarks/serving/compare_serving.py              # ~16 min here, with llama-cpp-python
    python benchmarks/serving/compare_serving.py --rounds 2   # alternate the setups twice (~32 min)
    python benchmarks/serving/compare_serving.py --quick      # ~6 min: smaller workloads

A setup whose process dies mid-run is left out of that round with its exit status
and last log lines; after each setup the nodes' fallback-prefill and KV-transfer
counters are printed and kept, so a 1p1d run that fell back to local prefill shows.
Writes benchmarks/results/serving_compare.json and serving_compare.png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from pathlib import Path

from splitserve.benchmarks.harness import (RESULTS, MixedShape, Workload, check_alive, mixed_workload, node_counters,
                                           pool, run_workload, warm_endpoint)
from splitserve.benchmarks.loadgen.bench.datasets import load_tokenizer, random_specs
from splitserve.benchmarks.serving.baselines import llama_server, transformers_static
from splitserve.benchmarks.serving.compare_report import report
from splitserve.common import metric_names as names
from splitserve.common.bundled import BUNDLED_MODEL_ID
from splitserve.deploy.launcher import Cluster

CLUSTERS = {  # setup -> Cluster kwargs
    "1p1d": dict(prefill_nodes=1, decode_nodes=1, cpus={"prefill": [0], "decode": [1], "router": [0]}),
    "colocated-2cpu": dict(prefill_nodes=0, decode_nodes=1, colocated=True,
                           cpus={"colocated": [0, 1], "router": [0]}),
    "colocated-1cpu": dict(prefill_nodes=0, decode_nodes=1, colocated=True,
                           cpus={"colocated": [1], "router": [0]}),
}


def workloads(a, tok) -> dict[str, Workload]:
    rng = random.Random(a.seed)
    mixed = mixed_workload(rng, tok, MixedShape(a.short, a.short_concurrency, a.short_input, a.short_output,
                                                a.long, a.long_input, a.long_output, a.long_start, a.long_interval))
    # output lengths spread +-50% so streams end at different times, as in serving: a
    # continuous batch refills the freed slots, a static batch runs to its longest
    tput = [s._replace(output_len=rng.randint(a.tput_output // 2, a.tput_output * 3 // 2))
            for s in random_specs(rng, tok, a.tput_requests, a.tput_input, a.tput_output)]
    # mixed: token-id prompts (exact lengths); throughput: text, the one prompt form every
    # server here takes (llama-cpp-python has no token-array prompts)
    return {"mixed": mixed, "throughput": Workload(tput, [0.0] * len(tput), 32, send_text=True)}


async def run_workloads(url: str, names: list[str], loads: dict[str, Workload], tok) -> dict:
    """{workload: (RunResult, Summary)} against the endpoint at ``url``."""
    warm = loads["mixed"].specs
    ep = await warm_endpoint(url, tok, [warm[0], warm[-1]], BUNDLED_MODEL_ID)
    return {name: await run_workload(ep, name, loads[name], tok) for name in names}


# node counters that say whether 1p1d really disaggregated: a transfer that failed is
# prefilled on the decode node, as colocated would
NODE_COUNTERS = (names.FALLBACK_PREFILLS, names.KV_TRANSFERS)


def run_cluster(setup: str, a, names, loads, tok, notes: dict) -> dict:
    print(f"\n=== {setup}: starting the cluster", flush=True)
    with Cluster(kv_backend="shm", kv_cache_memory=a.kv_cache_memory, **CLUSTERS[setup]) as c:
        out = asyncio.run(run_workloads(f"{c.url}/v1", names, loads, tok))
        notes.setdefault(setup, []).append(node_counters(c, NODE_COUNTERS))
        print(f"{setup} node counters: {notes[setup][-1]}", flush=True)
        check_alive(c)
        return out


def run_llama(venv: Path, names, loads, tok, log_path: Path) -> dict:
    print(f"\n=== llama-cpp: starting llama_cpp.server (log: {log_path})", flush=True)
    with llama_server(venv, log_path) as url:
        return asyncio.run(run_workloads(url, names, loads, tok))


def measure_transformers(loads) -> dict:
    print("\n=== transformers static batching (llama-cpp-python absent)", flush=True)
    specs = loads["throughput"]["specs"]
    return transformers_static([s.prompt for s in specs], [s.output_len for s in specs])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads, to check the setup")
    ap.add_argument("--rounds", type=int, default=1, help="run every setup this many times, "
                    "alternating; figures pool the rounds' requests (default %(default)s)")
    ap.add_argument("--setups", nargs="+", default=[*CLUSTERS, "llama-cpp"])
    ap.add_argument("--llama-venv", default=os.environ.get("LLAMA_CPP_VENV", "/work/llamacpp-venv"),
                    help="venv of benchmarks/serving/install_llama_cpp.sh (default %(default)s)")
    ap.add_argument("--short", type=int, default=48)
    ap.add_argument("--short-concurrency", type=int, default=16)
    ap.add_argument("--short-input", type=int, default=128)
    ap.add_argument("--short-output", type=int, default=64)
    ap.add_argument("--long", type=int, default=5)
    ap.add_argument("--long-input", type=int, default=1792)
    ap.add_argument("--long-output", type=int, default=8)
    ap.add_argument("--long-start", type=float, default=3.0)
    ap.add_argument("--long-interval", type=float, default=8.0)
    ap.add_argument("--tput-requests", type=int, default=48)
    ap.add_argument("--tput-input", type=int, default=64)
    ap.add_argument("--tput-output", type=int, default=96, help="mean; each is uniform in +-50%%")
    ap.add_argument("--kv-cache-memory", default="768MiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "serving_compare.json"))
    a = ap.parse_args()
    if a.quick:
        a.short, a.short_concurrency, a.short_output, a.long, a.long_interval = 16, 8, 32, 2, 6.0
        a.tput_requests, a.tput_output = 32, 32
    if not {0, 1} <= os.sched_getaffinity(0):
        print("error: this comparison pins roles to CPUs 0 and 1; they are not both available",
              file=sys.stderr)
        return 1
    os.sched_setaffinity(0, {0})  # the load generator (and the redis it starts) share CPU 0
    os.environ.setdefault("SPLITSERVE_QUIET", "1")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(None)
    loads = workloads(a, tok)
    venv = Path(a.llama_venv)
    with_llama = "llama-cpp" in a.setups and (venv / "bin" / "python").exists()
    if "llama-cpp" in a.setups and not with_llama:
        print(f"llama-cpp-python: skipped, no venv at {venv} (bash benchmarks/serving/install_llama_cpp.sh "
              "builds it, ~10 min); comparing against transformers static batching instead", flush=True)
    rounds: list[dict] = []  # per round: setup -> {workload: (RunResult, Summary)}
    notes: dict[str, list] = {}  # setup -> node counters after each round
    for rnd in range(a.rounds):
        print(f"\n##### round {rnd + 1}/{a.rounds}", flush=True)
        got = {}
        for setup in [s for s in a.setups if s in CLUSTERS]:
            try:
                got[setup] = run_cluster(setup, a, ["mixed", "throughput"], loads, tok, notes)
            except RuntimeError as e:  # a process did not start or died: report the others
                print(f"error: {setup} left out of this round: {e}", file=sys.stderr, flush=True)
        if with_llama:
            try:
                got["llama-cpp"] = run_llama(venv, ["throughput"], loads, tok,
                                             Path(a.out).with_name("llama_cpp_server.log"))
            except RuntimeError as e:
                print(f"error: llama-cpp left out of this round: {e}", file=sys.stderr, flush=True)
        rounds.append(got)
    baseline = measure_transformers(loads) if "llama-cpp" in a.setups and not with_llama else None
    report(a, pool(rounds), rounds, baseline, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
