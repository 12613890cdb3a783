"""The comparison's output (compare_serving.py): a side-by-side table with the
ratios against the targets, ``serving_compare.json`` and ``serving_compare.png``.

Targets:
    mixed       short-request TPOT p99, 1p1d / colocated   <= 0.5
                TTFT p50 of all requests, 1p1d / colocated <= 1.2
    throughput  output tok/s at 32 streams, 1p1d / llama-cpp-python
                (or transformers static batching when it is absent) >= 4
Must not measure anything.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from splitserve.benchmarks.loadgen.bench.report import request_records

TPOT_TARGET, TTFT_TARGET, TPUT_TARGET = 0.5, 1.2, 4.0
COLOCATED = ("colocated-2cpu", "colocated-1cpu")


def _get(d: dict, key: str, p: str) -> float:
    return d.get(key, {}).get(p, math.nan)


def key_figures(results: dict) -> dict:
    """setup -> the figures the table shows (ms, tok/s)."""
    rows = {}
    for setup, loads in results.items():
        row: dict[str, float | None] = {}  # figure -> value; None: not measured
        failed = 0  # failed requests, both workloads
        if "mixed" in loads:
            s = loads["mixed"][1]
            short, long = s.by_tag.get("short"), s.by_tag.get("long")
            row.update(short_tpot_p50=short.tpot_ms.get("p50"), short_tpot_p99=short.tpot_ms.get("p99"),
                       ttft_p50=s.ttft_ms.get("p50"), short_ttft_p50=short.ttft_ms.get("p50"),
                       long_ttft_p50=long.ttft_ms.get("p50") if long else None,
                       mixed_failed=s.failed)
            failed += s.failed
        if "throughput" in loads:
            s = loads["throughput"][1]
            row.update(tput_tok_s=s.output_throughput, tput_tpot_p50=s.tpot_ms.get("p50"),
                       tput_failed=s.failed)
            failed += s.failed
        row["failed"] = failed
        rows[setup] = row
    return rows


def ratios(rows: dict, baseline: dict | None) -> dict:
    out = {}
    ours = rows.get("1p1d", {})
    for colo in COLOCATED:
        if colo in rows and "short_tpot_p99" in ours:
            out[f"tpot_p99_1p1d_over_{colo}"] = ours["short_tpot_p99"] / rows[colo]["short_tpot_p99"]
            out[f"ttft_p50_1p1d_over_{colo}"] = ours["ttft_p50"] / rows[colo]["ttft_p50"]
    base_name, base = ("llama-cpp", rows["llama-cpp"].get("tput_tok_s")) if "llama-cpp" in rows else (
        ("transformers-static", baseline["output_throughput"]) if baseline else (None, None))
    if base and "tput_tok_s" in ours:
        out[f"tput_1p1d_over_{base_name}"] = ours["tput_tok_s"] / base
        best = max((r["tput_tok_s"], s) for s, r in rows.items() if s != "llama-cpp" and "tput_tok_s" in r)
        out[f"tput_best_over_{base_name}"] = best[0] / base
        out["tput_best_setup"] = best[1]
    return out


def _fmt(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.0f}"


def print_table(rows: dict, rat: dict, baseline: dict | None) -> None:
    cols = [("short_tpot_p50", "TPOT p50"), ("short_tpot_p99", "TPOT p99"), ("ttft_p50", "TTFT p50"),
            ("short_ttft_p50", "short TTFT"), ("long_ttft_p50", "long TTFT"), ("tput_tok_s", "32-stream tok/s"),
            ("failed", "failed requests")]
    print("\nmixed workload (short-request TPOT, TTFT of all / short / long requests, ms) and "
          "throughput at 32 streams")
    print(f"{'setup':<16}" + "".join(f"{name:>17}" for _, name in cols))
    for setup, r in rows.items():
        print(f"{setup:<16}" + "".join(f"{_fmt(r.get(k)):>17}" for k, _ in cols))
    if baseline:
        print(f"{'transformers':<16}" + f"{'':>17}" * 5 + f"{baseline['output_throughput']:>17.0f}")
    if any(r.get("failed") for r in rows.values()):
        print("warning: requests failed (errors in the JSON summaries); those setups' figures are suspect")
    print("\nratios (target):")
    for k, v in rat.items():
        if isinstance(v, str):
            continue
        target = (f"<= {TPOT_TARGET}" if k.startswith("tpot") else f"<= {TTFT_TARGET}"
                  if k.startswith("ttft") else f">= {TPUT_TARGET}")
        ok = v <= float(target[3:]) if target.startswith("<=") else v >= float(target[3:])
        print(f"  {k:<42} {v:6.2f}   ({target}: {'met' if ok else 'NOT met'})")


def plot(path: Path, results: dict, rows: dict, baseline: dict | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for setup, loads in results.items():
        if "mixed" not in loads:
            continue
        ok = [r for r in loads["mixed"][0].results if r.ok]
        for ax, vals in ((axes[0], [r.tpot_s for r in ok if r.tag == "short" and r.tpot_s]),
                         (axes[1], [r.ttft_s for r in ok])):
            xs = np.sort(np.asarray(vals) * 1000)
            ax.step(np.concatenate([xs[:1], xs]), np.arange(len(xs) + 1) / len(xs), where="post",
                    label=setup)
    axes[0].set_xlabel("mixed: short-request TPOT (ms)")
    axes[1].set_xlabel("mixed: TTFT, all requests (ms)")
    axes[1].set_xscale("log")
    for ax in axes[:2]:
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no mixed workload ran: no lines
            ax.legend(fontsize=8)
    bars = {s: r["tput_tok_s"] for s, r in rows.items() if "tput_tok_s" in r}
    if baseline:
        bars["transformers\nstatic"] = baseline["output_throughput"]
    axes[2].bar(list(bars), list(bars.values()), color="tab:blue")
    axes[2].set_ylabel("output tokens/s, 32 concurrent streams")
    axes[2].tick_params(axis="x", labelsize=8)
    fig.suptitle("splitserve: 1 prefill + 1 decode vs colocated (and llama-cpp-python), 2 CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def slim(rec: dict) -> dict:
    """A request's row for the JSON: what the CDFs need, rounded to 0.1 ms."""
    keep = ("tag", "ok", "start_s", "ttft_s", "tpot_s", "e2e_s", "prompt_tokens", "output_tokens")
    return {k: round(rec[k], 4) if isinstance(rec[k], float) else rec[k] for k in keep}


def report(args, results: dict, rounds: list[dict], baseline: dict | None,
           node_counters: dict) -> None:
    """``results``: the rounds pooled; ``rounds``: each round's own (same shape)."""
    rows = key_figures(results)
    rat = ratios(rows, baseline)
    per_round = [{"figures": (f := key_figures(got)), "ratios": ratios(f, baseline)} for got in rounds]
    print_table(rows, rat, baseline)
    if len(rounds) > 1:
        print("\nper round: " + "; ".join(
            ", ".join(f"{k} {v:.2f}" for k, v in r["ratios"].items() if not isinstance(v, str))
            for r in per_round))
    out = Path(args.out)
    payload = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": vars(args), "figures": rows,
               "ratios": rat, "targets": {"tpot_p99": TPOT_TARGET, "ttft_p50": TTFT_TARGET,
                                          "throughput": TPUT_TARGET},
               "transformers_static": baseline, "node_counters": node_counters,
               "rounds": per_round,
               "setups": {s: {w: {"summary": summ.to_dict(),
                                  "requests": [slim(rec) for rec in request_records(r.results)]}
                              for w, (r, summ) in loads.items()} for s, loads in results.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    plot(out.with_suffix(".png"), results, rows, baseline)
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
