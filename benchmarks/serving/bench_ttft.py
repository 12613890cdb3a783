"""Does disaggregation cost time to first token? 512-token prompts, disaggregated
(prefill node -> KV transfer -> decode node) against colocated (one node does both),
through the real router, same run.

    .venv/bin/python benchmarks/serving/bench_ttft.py [--requests 12] [--backend shm]

Every prompt is fresh random token ids (no prefix-cache hits); requests are
sequential so each measures latency, not queueing. One torch thread per node.
Writes benchmarks/results/ttft.json and ttft.png.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import openai

from splitserve.benchmarks.harness import RESULTS
from splitserve.common.kv_backends import backend_names
from splitserve.deploy.launcher import Cluster

MODEL = "SmolLM2-135M-Instruct"


def measure(cluster: Cluster, n: int, prompt_len: int, seed: int) -> list[float]:
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=300)
    rng = random.Random(seed)
    out = []
    for i in range(n + 1):  # the first request warms up the processes
        prompt = [rng.randrange(100, 49000) for _ in range(prompt_len)]
        start = time.perf_counter()
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True)
        ttft = None
        for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].text is not None:
                ttft = time.perf_counter() - start
        if i:
            assert ttft is not None, "the stream carried no text"
            out.append(ttft)
            print(f"  {i}/{n}: {ttft * 1000:.0f} ms", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--backend", default="shm", choices=backend_names())
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk size (blocks stream per chunk)")
    ap.add_argument("--rounds", type=int, default=2, help="alternate the two setups this many times")
    ap.add_argument("--out", default=str(RESULTS / "ttft.json"))
    args = ap.parse_args()
    os.environ.setdefault("SPLITSERVE_QUIET", "1")
    node_args = ["--prefill-chunk-size", str(args.chunk)]
    samples: dict[str, list[float]] = {"disaggregated": [], "colocated": []}  # setup -> TTFTs, seconds
    for rnd in range(args.rounds):
        for name in samples:
            print(f"round {rnd + 1}/{args.rounds}: {name}", flush=True)
            cluster = Cluster(prefill_nodes=1 if name == "disaggregated" else 0, decode_nodes=1,
                              colocated=name == "colocated", kv_backend=args.backend,
                              kv_cache_memory="256MiB", extra_node_args=node_args)
            with cluster:
                samples[name] += measure(cluster, args.requests, args.prompt_len, seed=rnd)
    med = {k: statistics.median(v) for k, v in samples.items()}
    ratio = med["disaggregated"] / med["colocated"]
    summary = {"ttft_p50_ms": {k: round(v * 1000, 1) for k, v in med.items()},
               "disaggregated_over_colocated": round(ratio, 3), "target_max_ratio": 1.10,
               "backend": args.backend, "prompt_len": args.prompt_len, "chunk": args.chunk}
    print(json.dumps(summary, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "samples_s": samples}, indent=2))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.boxplot([[x * 1000 for x in samples[k]] for k in samples], tick_labels=list(samples))
    ax.set_ylabel(f"TTFT ms ({args.prompt_len}-token prompt)")
    ax.set_title(f"disaggregated / colocated = {ratio:.2f} (p50)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
