"""Does anything degrade over a long steady run: failures, memory, latency? A supervised
local cluster as ``splitserve up`` runs it (Redis with a password, the cluster token, tcp
KV) under a steady open-loop rate for a long time:

    python -m splitserve.benchmarks.reliability.bench_soak [--duration 1800] [--rate 1] [--window 300]

- failed requests (want 0);
- resident memory of every process (router, nodes, Redis) sampled every --sample-s:
  growth from the end of the first window to the end of the run (want < 50 MB each);
- p99 latency drift (want < 10%), measured against a control: the last window starts a
  FRESH cluster of the same config the same way, warms it up for --warmup-s, then sends
  one stream alternating between the aged and the fresh cluster (soak_control.py),
  --control-rate req/s to each. Drift = p99(aged) / p99(fresh) - 1 over that window: both
  clusters see the same machine load at the same moments, so the shared machine's noise
  cancels. The old figure, the last window's p99 against the first's, is kept for the
  record only (it follows the machine's load, not the cluster's age).

Prints a line per window while it runs and writes benchmarks/results/soak.json and
soak.png (RSS per process, latency per window with the control, and the control
window's latency distribution of both clusters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from splitserve.benchmarks.harness import RESULTS, Outcome, RequestResult, run_load
from splitserve.benchmarks.reliability.soak_control import (
    control_drift,
    ok_pairs,
    percentile,
    run_interleaved,
)
from splitserve.common.auth import new_cluster_token
from splitserve.deploy.launcher import Cluster, parse_cpus
from splitserve.deploy.supervisor import Supervisor

PROMPTS = ["Write a haiku about the sea.", "What is the capital of France?",
           "Name three colors of the rainbow.", "Explain rain to a child in one sentence.",
           "List four animals that live in the ocean.", "Why is the sky blue? Answer briefly."]
DRIFT_TARGET = 0.10  # p99 latency drift under 10%
TARGET_WHY = ("aged and fresh clusters of the same config were sent alternate requests of one stream in the "
              "same window, so both saw the same machine load; their p99 ratio cancels the shared machine's "
              "noise, which moves a window's p99 by up to 3x between windows here (see windows[].loadavg_1m)")


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


async def sample_memory(c: Cluster, every_s: float, t0: float, samples: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        row: dict[str, float | None] = {"t": round(time.monotonic() - t0, 1)}  # "t", then process -> RSS MiB
        for p in c.procs:
            row[p.name] = rss_mb(p.popen.pid)
        if c.redis is not None:
            row["redis"] = rss_mb(c.redis.pid)
        samples.append(row)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


def window_row(w: int, t0: float, batch: list[RequestResult]) -> dict:
    ok = [r.ended - r.started for r in batch if r.outcome is Outcome.OK]
    return {"window": w, "end_s": round(time.monotonic() - t0, 1), "requests": len(batch),
            "failed": sum(r.outcome is Outcome.FAILED for r in batch),
            "p50_s": round(statistics.median(ok), 4) if ok else None,
            "p99_s": round(percentile(ok, 0.99), 4) if ok else None, "loadavg_1m": os.getloadavg()[0]}


def new_cluster(args) -> Cluster:
    """The soak's cluster as ``splitserve up`` starts it; the aged one and its fresh control alike."""
    return Cluster(prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes, kv_backend="tcp",
                   kv_cache_memory=args.kv_cache_memory, cluster_token=new_cluster_token(),
                   redis_password=new_cluster_token(), cpus=parse_cpus(args.cpus))


def start_supervised(c: Cluster) -> Supervisor:
    c.start()
    return c.supervise()


def report(row: dict, samples: list[dict], label: str) -> None:
    last = samples[-1] if samples else {}
    print(f"[soak] {label}: {json.dumps(row)} rss_mb="
          f"{ {k: round(v) for k, v in last.items() if k != 't' and v is not None} }", flush=True)


async def soak(c: Cluster, fresh: Cluster, sups: dict[str, Supervisor], args) -> dict:
    """Windows of steady load on the aged cluster ``c``; the fresh control starts during the
    last aged-only window and shares the final (control) window with it (its supervisor
    lands in ``sups["fresh"]``)."""
    t0 = time.monotonic()
    samples: list[dict] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_memory(c, args.sample_s, t0, samples, stop))
    windows, results = [], []
    n_windows = max(2, round(args.duration / args.window))
    starting = None
    for w in range(n_windows - 1):
        if w == n_windows - 2:  # its model loads beside this window's load: no gap in the aged stream
            starting = asyncio.create_task(asyncio.to_thread(start_supervised, fresh))
        batch = await run_load(c.url, args.rate, args.window, PROMPTS, args.max_tokens, seed=w)
        results += batch
        windows.append(window_row(w, t0, batch))
        report(windows[-1], samples, f"window {w + 1}/{n_windows}")
    assert starting is not None, "the last loop window started the fresh cluster"
    sups["fresh"] = await starting
    t_measure = time.monotonic() + args.warmup_s  # pairs sent before this warm the fresh cluster up
    aged, fresh_res = await run_interleaved([c.url, fresh.url], args.control_rate, args.warmup_s + args.window,
                                            PROMPTS, args.max_tokens)
    results += aged
    measured = [r for r in aged if r.started >= t_measure]
    windows.append(window_row(n_windows - 1, t0, measured) | {"control": True, "warmup_requests":
                                                                len(aged) - len(measured)})
    report(windows[-1], samples, f"window {n_windows}/{n_windows} (aged, beside the fresh control)")
    fresh_measured = [r for r in fresh_res if r.started >= t_measure]
    fresh_row = window_row(n_windows - 1, t0, fresh_measured)
    print(f"[soak] control (fresh cluster): {json.dumps(fresh_row)}", flush=True)
    stop.set()
    await sampler
    pairs = ok_pairs(aged, fresh_res, t_measure)
    return {"windows": windows, "control_fresh": fresh_row, "rss_samples": samples,
            "control_pairs_s": [[round(a, 4), round(f, 4)] for a, f in pairs],
            "control_drift": control_drift(pairs)._asdict(),
            "errors": sorted({r.error for r in results + fresh_res
                              if r.outcome is Outcome.FAILED and r.error is not None})[:5]}


def summarize(out: dict, first_window_s: float) -> dict:
    samples = out["rss_samples"]
    base = next((s for s in samples if s["t"] >= first_window_s), samples[0])
    end = samples[-1]
    growth = {k: round(end[k] - base[k], 1) for k in base if k != "t" and base.get(k) and end.get(k)}
    w, d = out["windows"], out["control_drift"]
    p99_first, p99_last = w[0]["p99_s"], w[-1]["p99_s"]
    return {"requests": sum(x["requests"] + x.get("warmup_requests", 0) for x in w),
            "failed": sum(x["failed"] for x in w), "control_fresh_failed": out["control_fresh"]["failed"],
            "rss_growth_mb_after_first_window": growth, "max_rss_growth_mb": max(growth.values(), default=0.0),
            "target_p99_drift": d["p99_drift"], "target_p99_drift_ci90": d["p99_drift_ci90"],
            "target_met": d["p99_drift"] < DRIFT_TARGET,
            "target_figure": "p99(aged) / p99(fresh) - 1 in the control window (want < 0.10)",
            "target_why": TARGET_WHY,
            "control_p99_aged_s": d["p99_aged_s"], "control_p99_fresh_s": d["p99_fresh_s"],
            "control_p50_ratio": d["p50_ratio"], "control_pairs": d["pairs"],
            "record_only_p99_first_window_s": p99_first, "record_only_p99_last_window_s": p99_last,
            "record_only_p99_last_vs_first": round(p99_last / p99_first - 1, 3) if p99_first and p99_last else None}


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.5))
    samples = out["rss_samples"]
    for name in (k for k in samples[0] if k != "t"):
        a.plot([s["t"] / 60 for s in samples], [s.get(name) for s in samples], label=name)
    a.set(xlabel="minutes", ylabel="RSS (MiB)", title="resident memory per process (aged cluster)")
    a.legend(fontsize=8)
    w, f = out["windows"], out["control_fresh"]
    b.plot([x["end_s"] / 60 for x in w], [x["p99_s"] for x in w], "o-", color="C0", label="p99 aged")
    b.plot([x["end_s"] / 60 for x in w], [x["p50_s"] for x in w], "o-", color="C1", label="p50 aged")
    b.plot([f["end_s"] / 60], [f["p99_s"]], "s", color="C2", markersize=9, label="p99 fresh (control)")
    b.plot([f["end_s"] / 60], [f["p50_s"]], "D", color="C3", markersize=8, label="p50 fresh (control)")
    b.set(xlabel="minutes (window end)", ylabel="end-to-end latency (s)", ylim=(0, None),
          title="latency per window; last = control window")
    b.legend(fontsize=8)
    pairs = out["control_pairs_s"]
    for i, (name, color) in enumerate((("aged", "C0"), ("fresh", "C2"))):
        xs = sorted(p[i] for p in pairs)
        c.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], color=color, label=name)
    d = out["control_drift"]
    c.set(xlabel="end-to-end latency (s)", ylabel="fraction of requests",
          title=f"control window, interleaved: p99 drift {d['p99_drift']:+.1%}")
    c.axhline(0.99, color="grey", lw=0.5, ls="--")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load, the control window included")
    ap.add_argument("--window", type=float, default=300.0, help="seconds per latency window (the control's too)")
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second")
    ap.add_argument("--control-rate", type=float, default=None,
                    help="requests per second to EACH of the aged and fresh cluster in the control window "
                         "(default: --rate, the aged cluster's steady rate)")
    ap.add_argument("--warmup-s", type=float, default=30.0,
                    help="seconds of interleaved load before the control window, not measured")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--sample-s", type=float, default=15.0, help="seconds between RSS samples")
    ap.add_argument("--prefill-nodes", type=int, default=1)
    ap.add_argument("--decode-nodes", type=int, default=1)
    ap.add_argument("--kv-cache-memory", default="128MiB")
    ap.add_argument("--cpus", nargs="*", default=[], metavar="ROLE=CPU[,CPU...]",
                    help="pin both clusters' processes as `splitserve up --cpus` does")
    ap.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = ap.parse_args()
    if args.control_rate is None:
        args.control_rate = args.rate
    os.environ.setdefault("SPLITSERVE_QUIET", "1")
    c, fresh = new_cluster(args), new_cluster(args)
    sups = {"aged": start_supervised(c)}
    try:
        out = asyncio.run(soak(c, fresh, sups, args))
        out["restarts"] = {name: {m["name"]: m["restarts"] for m in sup.status()["members"]}
                           for name, sup in sups.items()}
    finally:
        fresh.stop()
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
