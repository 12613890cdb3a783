"""Results out: a text table, a JSON file, and PNG plots (latency CDFs per run;
latency against request rate when several rates ran). Must not measure anything."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from .client import RequestResult
from .metrics import Summary

_LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def format_summary(s: Summary, title: str) -> str:
    rows = [f"{'=' * 22} {title} {'=' * max(2, 44 - len(title))}",
            f"{'Successful requests:':<40}{s.completed}",
            f"{'Failed requests:':<40}{s.failed}",
            f"{'Duration (s):':<40}{s.duration_s:.2f}",
            f"{'Input tokens / output tokens:':<40}{s.total_input_tokens} / {s.total_output_tokens}",
            f"{'Request throughput (req/s):':<40}{s.request_throughput:.3f}",
            f"{'Output token throughput (tok/s):':<40}{s.output_throughput:.2f}",
            f"{'Total token throughput (tok/s):':<40}{s.total_token_throughput:.2f}",
            f"{'Cached prompt-token share:':<40}{s.cached_share:.3f}"]
    if s.goodput is not None and s.slo is not None:
        rows.append(f"{'Goodput (req/s) under SLO:':<40}{s.goodput:.3f}  ({s.good_requests}/"
                    f"{s.completed} good; TTFT <= {s.slo['ttft_ms']:g} ms, TPOT <= "
                    f"{s.slo['tpot_ms']:g} ms)")
    if s.usage_reported < s.completed:
        rows.append(f"note: {s.completed - s.usage_reported} streams sent no usage; their token "
                    "counts are max_tokens (finish_reason length) or text chunks, prompt tokens as built")
    for key, name in _LATENCIES:
        stats = getattr(s, key)
        if stats:
            rows.append(f"{name + ' ms':<12}" + "  ".join(f"{k} {v:9.1f}" for k, v in stats.items()))
    for msg, n in s.errors.items():
        rows.append(f"error x{n}: {msg}")
    for tag, sub in s.by_tag.items():
        rows.append(f"  [{tag}] {sub.completed} ok, {sub.output_throughput:.1f} tok/s, " + ", ".join(
            f"{name} p50/p99 {getattr(sub, key).get('p50', float('nan')):.0f}/"
            f"{getattr(sub, key).get('p99', float('nan')):.0f} ms"
            for key, name in _LATENCIES if key != "itl_ms"))
    return "\n".join(rows)


def request_records(results: list[RequestResult]) -> list[dict]:
    """Per-request rows for the JSON (the generated text left out)."""
    out = []
    for r in results:
        d = dataclasses.asdict(r)
        d.pop("text")
        d["tpot_s"] = r.tpot_s
        out.append(d)
    return out


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, allow_nan=True))


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_cdfs(path: Path, runs: list[tuple[str, list[RequestResult]]], title: str = "") -> None:
    """TTFT, TPOT, ITL, E2E empirical CDFs, one line per labelled run."""
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, name) in zip(axes.flat, _LATENCIES):
        for label, results in runs:
            ok = [r for r in results if r.ok]
            values = {"ttft_ms": [r.ttft_s for r in ok],
                      "tpot_ms": [t for r in ok if (t := r.tpot_s) is not None],
                      "itl_ms": [x for r in ok for x in r.itl_s], "e2e_ms": [r.e2e_s for r in ok]}[key]
            if values:
                xs = np.sort(np.asarray(values) * 1000)
                ys = np.arange(0, len(xs) + 1) / len(xs)  # from 0 at the smallest value
                ax.step(np.concatenate([xs[:1], xs]), ys, where="post", label=label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if key != "itl_ms" else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_vs_rate(path: Path, rates: list[float], summaries: list[Summary]) -> None:
    """p50 and p99 of TTFT, TPOT and E2E against the offered request rate."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    finite = [r if r != float("inf") else None for r in rates]
    top = max((r for r in finite if r is not None), default=1.0)
    xs = [r if r is not None else top * 2 for r in finite]  # inf drawn at twice the top rate
    for ax, (key, name) in zip(axes, [_LATENCIES[0], _LATENCIES[1], _LATENCIES[3]]):
        for p in ("p50", "p99"):
            ax.plot(xs, [getattr(s, key).get(p, np.nan) for s in summaries], marker="o", label=p)
        ax.set_xlabel("request rate (req/s; rightmost = inf)" if None in finite else "request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
