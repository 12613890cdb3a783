"""Soak benchmark (issue 12): a supervised local cluster as ``splitserve up`` runs it
(Redis with a password, the cluster token, tcp KV) under a steady open-loop rate for
a long time, checking that nothing degrades:

    python -m splitserve.benchmarks.bench_soak [--duration 1800] [--rate 1] [--window 300]

- failed requests (want 0);
- resident memory of every process (router, nodes, Redis) sampled every --sample-s:
  growth from the end of the first window to the end of the run (want < 50 MB each);
- end-to-end latency p50/p99 per --window: the last window's p99 against the first's
  (want drift < 10%).

Prints a line per window while it runs and writes benchmarks/results/soak.json and
soak.png (RSS per process and p99 per window over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from splitserve.benchmarks.faults_client import Outcome, RequestResult, run_load
from splitserve.common.auth import new_cluster_token
from splitserve.deploy.launcher import Cluster

RESULTS = Path(__file__).with_name("results")
PROMPTS = ["Write a haiku about the sea.", "What is the capital of France?",
           "Name three colors of the rainbow.", "Explain rain to a child in one sentence.",
           "List four animals that live in the ocean.", "Why is the sky blue? Answer briefly."]


def rss_mb(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def sample_memory(c: Cluster, every_s: float, t0: float, samples: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        row = {"t": round(time.monotonic() - t0, 1)}
        for p in c.procs:
            row[p.name] = rss_mb(p.popen.pid)
        if c.redis is not None:
            row["redis"] = rss_mb(c.redis.pid)
        samples.append(row)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def soak(c: Cluster, args) -> dict:
    t0 = time.monotonic()
    samples: list[dict] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_memory(c, args.sample_s, t0, samples, stop))
    windows, results = [], []
    n_windows = max(1, round(args.duration / args.window))
    for w in range(n_windows):
        batch: list[RequestResult] = await run_load(c.url, args.rate, args.window, PROMPTS, args.max_tokens,
                                                    seed=w)
        results += batch
        ok = [r.ended - r.started for r in batch if r.outcome is Outcome.OK]
        row = {"window": w, "end_s": round(time.monotonic() - t0, 1), "requests": len(batch),
               "failed": sum(r.outcome is Outcome.FAILED for r in batch),
               "p50_s": round(statistics.median(ok), 4) if ok else None,
               "p99_s": round(percentile(ok, 0.99), 4) if ok else None, "loadavg_1m": os.getloadavg()[0]}
        windows.append(row)
        last = samples[-1] if samples else {}
        print(f"[soak] window {w + 1}/{n_windows}: {json.dumps(row)} rss_mb="
              f"{ {k: round(v) for k, v in last.items() if k != 't' and v is not None} }", flush=True)
    stop.set()
    await sampler
    return {"windows": windows, "rss_samples": samples,
            "errors": sorted({r.error for r in results if r.outcome is Outcome.FAILED})[:5]}


def summarize(out: dict, first_window_s: float) -> dict:
    samples = out["rss_samples"]
    base = next((s for s in samples if s["t"] >= first_window_s), samples[0])
    end = samples[-1]
    growth = {k: round(end[k] - base[k], 1) for k in base if k != "t" and base.get(k) and end.get(k)}
    w = out["windows"]
    p99_first, p99_last = w[0]["p99_s"], w[-1]["p99_s"]
    return {"requests": sum(x["requests"] for x in w), "failed": sum(x["failed"] for x in w),
            "rss_growth_mb_after_first_window": growth, "max_rss_growth_mb": max(growth.values(), default=0.0),
            "p99_first_s": p99_first, "p99_last_s": p99_last,
            "p99_drift": round(p99_last / p99_first - 1, 3) if p99_first and p99_last else None}


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    samples = out["rss_samples"]
    for name in (k for k in samples[0] if k != "t"):
        a.plot([s["t"] / 60 for s in samples], [s.get(name) for s in samples], label=name)
    a.set(xlabel="minutes", ylabel="RSS (MiB)", title="resident memory per process")
    a.legend(fontsize=8)
    w = out["windows"]
    b.plot([x["end_s"] / 60 for x in w], [x["p99_s"] for x in w], "o-", label="p99")
    b.plot([x["end_s"] / 60 for x in w], [x["p50_s"] for x in w], "o-", label="p50")
    b.set(xlabel="minutes", ylabel="end-to-end latency (s)", title="latency per window", ylim=(0, None))
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    ap.add_argument("--window", type=float, default=300.0, help="seconds per latency window")
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--sample-s", type=float, default=15.0, help="seconds between RSS samples")
    ap.add_argument("--prefill-nodes", type=int, default=1)
    ap.add_argument("--decode-nodes", type=int, default=1)
    ap.add_argument("--kv-cache-memory", default="128MiB")
    ap.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = ap.parse_args()
    os.environ.setdefault("SPLITSERVE_QUIET", "1")
    c = Cluster(prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes, kv_backend="tcp",
                kv_cache_memory=args.kv_cache_memory, cluster_token=new_cluster_token(),
                redis_password=new_cluster_token())
    c.start()
    sup = c.supervise()
    try:
        out = asyncio.run(soak(c, args))
        out["restarts"] = {m["name"]: m["restarts"] for m in sup.status()["members"]}
    finally:
        c.stop()
    with open("/proc/loadavg") as f:
        out["loadavg_at_end"] = f.read().split()[:3]
    out["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    out["summary"] = summarize(out, args.window)
    print(json.dumps(out["summary"], indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    plot(out, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
