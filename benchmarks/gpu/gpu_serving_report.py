"""The output of bench_gpu_serving.py: the figures against the GPU serving targets, a table
on stdout, the JSON (gpu/contract.py's "environment" and "targets" at its top) and a PNG
beside it.

    TTFT p50, disaggregated / colocated, per prompt length   <= 1.10
    short-request TPOT p99 in the mixed workload, same ratio   <= 0.5
    KV transfer rate (prefill node: bytes sent / seconds in sends) beside the device copy rate

The targets' values live in gpu/contract.py's TARGETS. Every round's requests of a setup and
workload are pooled for the percentiles; the per-round ratios are kept to show the
spread. Must not measure anything.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from splitserve.benchmarks.gpu.contract import TARGETS, target_row, write_json
from splitserve.benchmarks.harness import pool
from splitserve.benchmarks.loadgen.bench.report import request_records
from splitserve.common import metric_names as names

SETUPS = ("disaggregated", "colocated")
DISAGG, COLOC = SETUPS
TTFT, TPOT = "ttft_p50_disagg_over_colocated", "short_tpot_p99_disagg_over_colocated"  # TARGETS kinds


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def _counter(deltas: dict[str, float], name: str, label: str = "") -> float:
    """Sum of the series of ``name`` (whose labels contain ``label``) in ``deltas``."""
    return sum(v for k, v in deltas.items() if k.split("{")[0] == name and label in k)


def _stat(runs: dict, setup: str, workload: str, key: str, p: str = "p50", tag: str | None = None) -> float | None:
    """Percentile ``p`` of ``key`` (e.g. "ttft_ms") in ``runs`` ({setup: {workload: (RunResult,
    Summary)}}), of the requests tagged ``tag`` (None: all); None when not measured."""
    got = runs.get(setup, {}).get(workload)
    s = None if got is None else got[1] if tag is None else got[1].by_tag.get(tag)
    return getattr(s, key).get(p) if s is not None else None


def _failed(runs: dict, workload: str) -> dict[str, int]:
    return {s: runs[s][workload][1].failed if workload in runs.get(s, {}) else 0 for s in SETUPS}


def _overlap(results) -> tuple[int, int]:
    """(short requests running while some long prompt was being prefilled, short requests)."""
    ok = [r for r in results if r.ok]
    windows = [(r.start_s, r.start_s + r.ttft_s) for r in ok if r.tag == "long"]
    short = [r for r in ok if r.tag == "short"]
    hit = sum(any(a < r.start_s + r.e2e_s and r.start_s < b for a, b in windows) for r in short)
    return hit, len(short)


def figures(plan, rounds: list[dict], copy_gb_s: float) -> dict:
    per_round = [{s: r["results"] for s, r in got.items()} for got in rounds]
    both = [g for g in per_round if DISAGG in g and COLOC in g]
    pooled = pool(per_round)
    ttft: dict[str, dict] = {}  # prompt length -> TTFT figures
    by_len: dict[str, dict[str, float | None]] = {}  # prompt length -> KV bytes sent, seconds, GB/s
    kv: dict[str, object] = {"by_prompt_len": by_len, "copy_gb_s": copy_gb_s}
    out: dict[str, dict] = {"ttft": ttft, "mixed": {}, "kv_transfer": kv}
    sent = secs = 0.0
    for n in plan.ttft_lens:
        w = f"ttft_{n}"
        p50 = {s: _stat(pooled, s, w, "ttft_ms") for s in SETUPS}
        ratio = _ratio(p50[DISAGG], p50[COLOC])
        ttft[str(n)] = {
            "p50_ms": p50, "disagg_over_colocated": ratio,
            "per_round": [_ratio(_stat(g, DISAGG, w, "ttft_ms"), _stat(g, COLOC, w, "ttft_ms")) for g in both],
            "failed": _failed(pooled, w)}
        b = sum(_counter(g[DISAGG]["counters"][w], names.KV_BYTES_SENT) for g in rounds if DISAGG in g)
        t = sum(_counter(g[DISAGG]["counters"][w], names.KV_SEND_SECONDS) for g in rounds if DISAGG in g)
        sent, secs = sent + b, secs + t
        by_len[str(n)] = {"bytes": b, "send_seconds": t, "gb_s": b / t / 1e9 if t else None}
    gb_s = sent / secs / 1e9 if secs else None
    kv.update(gb_s=gb_s, over_copy=_ratio(gb_s, copy_gb_s))
    p99 = {s: _stat(pooled, s, "mixed", "tpot_ms", "p99", "short") for s in SETUPS}
    ratio = _ratio(p99[DISAGG], p99[COLOC])
    overlap = {s: [sum(x) for x in zip(*(_overlap(g[s]["mixed"][0].results) for g in per_round if s in g))]
               for s in SETUPS}
    out["mixed"] = {"short_tpot_p99_ms": p99, "disagg_over_colocated": ratio,
                    "per_round": [_ratio(_stat(g, DISAGG, "mixed", "tpot_ms", "p99", "short"),
                                         _stat(g, COLOC, "mixed", "tpot_ms", "p99", "short")) for g in both],
                    "short_tpot_p50_ms": {s: _stat(pooled, s, "mixed", "tpot_ms", "p50", "short") for s in SETUPS},
                    "long_ttft_p50_ms": {s: _stat(pooled, s, "mixed", "ttft_ms", "p50", "long") for s in SETUPS},
                    "short_during_long_prefill": {s: f"{v[0]}/{v[1]}" if v else None for s, v in overlap.items()},
                    "failed": _failed(pooled, "mixed")}
    every = [g[DISAGG]["counters"][w] for g in rounds if DISAGG in g for w in g[DISAGG]["counters"]]
    out["disaggregation_check"] = {
        "fallback_prefills": sum(_counter(d, names.FALLBACK_PREFILLS) for d in every),
        "transfers_owned": sum(_counter(d, names.KV_TRANSFERS, 'state="owned"') for d in every),
        "transfers_failed": sum(_counter(d, names.KV_TRANSFERS, 'state="failed"') for d in every)}
    return out


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def targets(f: dict) -> list[dict]:
    """The serving targets (gpu/contract.py's TARGETS): one TTFT row per prompt length, one TPOT row."""
    return [target_row(TTFT, t["disagg_over_colocated"], n) for n, t in f["ttft"].items()] + [
        target_row(TPOT, f["mixed"]["disagg_over_colocated"])]


def _verdict(row: dict) -> str:
    return f"{row['op']} {row['target']} " + {True: "met", False: "NOT met", None: "not measured"}[row["met"]]


def table(f: dict, rows_of_targets: list[dict]) -> str:
    verdicts = [_verdict(r) for r in rows_of_targets]  # the TTFT rows in f["ttft"]'s order, then TPOT
    rows = [f"{'':34}{DISAGG:>15}{COLOC:>12}{'ratio':>8}  target"]
    for (n, t), verdict in zip(f["ttft"].items(), verdicts):
        rows.append(f"{f'TTFT p50, {n}-token prompts (ms)':34}{_fmt(t['p50_ms'][DISAGG]):>15}"
                    f"{_fmt(t['p50_ms'][COLOC]):>12}{_fmt(t['disagg_over_colocated'], '.3f'):>8}  {verdict}")
    m = f["mixed"]
    rows.append(f"{'mixed: short TPOT p99 (ms)':34}{_fmt(m['short_tpot_p99_ms'][DISAGG]):>15}"
                f"{_fmt(m['short_tpot_p99_ms'][COLOC]):>12}{_fmt(m['disagg_over_colocated'], '.3f'):>8}  "
                f"{verdicts[-1]}")
    for key, label in (("short_tpot_p50_ms", "mixed: short TPOT p50 (ms)"),
                       ("long_ttft_p50_ms", "mixed: long TTFT p50 (ms)")):
        rows.append(f"{label:34}{_fmt(m[key][DISAGG]):>15}{_fmt(m[key][COLOC]):>12}")
    rows.append(f"{'mixed: shorts during a long prefill':34}{m['short_during_long_prefill'][DISAGG] or '-':>15}"
                f"{m['short_during_long_prefill'][COLOC] or '-':>12}")
    kv = f["kv_transfer"]
    per = ", ".join(f"{n}: {_fmt(v['gb_s'], '.2f')}" for n, v in kv["by_prompt_len"].items())
    rows.append(f"KV transfer {_fmt(kv['gb_s'], '.2f')} GB/s ({per}) vs device copy {_fmt(kv['copy_gb_s'], '.1f')} "
                f"GB/s: {_fmt(kv['over_copy'], '.1%')} of the copy rate")
    c = f["disaggregation_check"]
    rows.append(f"disaggregated: {c['transfers_owned']:.0f} transfers owned, {c['transfers_failed']:.0f} failed, "
                f"{c['fallback_prefills']:.0f} local-prefill fallbacks")
    if c["fallback_prefills"] or c["transfers_failed"]:
        rows.append("WARNING: some disaggregated requests were prefilled on the decode node after all: those "
                    "figures are not disaggregation's (see the nodes' logs without SPLITSERVE_QUIET=1)")
    return "\n".join(rows)


def plot(path: Path, f: dict, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    lens = list(f["ttft"])
    for i, s in enumerate(SETUPS):
        axes[0].bar([j + 0.4 * i for j in range(len(lens))], [f["ttft"][n]["p50_ms"][s] or 0 for n in lens],
                    0.4, label=s)
    axes[0].set_xticks([j + 0.2 for j in range(len(lens))], [f"{n} tokens" for n in lens])
    axes[0].set_ylabel("TTFT p50 (ms)")
    axes[0].set_title(f"TTFT p50 (target ratio {TARGETS[TTFT].op} {TARGETS[TTFT].target})")
    m = f["mixed"]
    for i, s in enumerate(SETUPS):
        axes[1].bar([0.4 * i, 1 + 0.4 * i], [m["short_tpot_p50_ms"][s] or 0, m["short_tpot_p99_ms"][s] or 0],
                    0.4, label=s)
    axes[1].set_xticks([0.2, 1.2], ["p50", "p99"])
    axes[1].set_ylabel("short-request TPOT (ms)")
    axes[1].set_title(f"mixed workload (target p99 ratio {TARGETS[TPOT].op} {TARGETS[TPOT].target})")
    kv = f["kv_transfer"]
    labels = [f"KV {n}" for n in kv["by_prompt_len"]] + ["device copy"]
    axes[2].bar(labels, [v["gb_s"] or 0 for v in kv["by_prompt_len"].values()] + [kv["copy_gb_s"]])
    axes[2].set_ylabel("GB/s")
    axes[2].set_title("KV transfer rate vs device copy")
    for ax in axes[:2]:
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(out: Path, plan, rounds: list[dict], errors: list[str], copy_gb_s: float, env: dict,
           smoke: bool) -> bool:
    """Print the table, write ``out`` and its PNG; True when every figure was measured with
    no failed request, no setup left out and no disaggregated request prefilled locally."""
    f = figures(plan, rounds, copy_gb_s)
    rows_of_targets = targets(f)
    print(table(f, rows_of_targets), flush=True)
    pooled = pool([{s: r["results"] for s, r in got.items()} for got in rounds])
    payload = {
        "environment": env, "targets": rows_of_targets, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "mode": "smoke" if smoke else "full", "plan": {**plan._asdict(), "mixed": plan.mixed._asdict()},
        "figures": f, "errors": errors,
        "rounds": [{s: {"start_s": r["start_s"], "counters": r["counters"], "commands": r["commands"],
                        "summaries": {w: summ.to_dict() for w, (_, summ) in r["results"].items()}}
                    for s, r in got.items()} for got in rounds],
        "requests": {s: {w: request_records(res.results) for w, (res, _) in loads.items()}
                     for s, loads in pooled.items()}}
    write_json(out, payload)
    plot(out.with_suffix(".png"), f, f"{env.get('device_name', env['device'])}: 1 prefill + 1 decode vs colocated")
    print(f"wrote {out} and {out.with_suffix('.png')}", flush=True)
    failed = sum(sum(t["failed"].values()) for t in f["ttft"].values()) + sum(f["mixed"]["failed"].values())
    measured = [t["disagg_over_colocated"] for t in f["ttft"].values()] + [
        f["mixed"]["disagg_over_colocated"], f["kv_transfer"]["gb_s"]]
    check = f["disaggregation_check"]
    fell_back = check["fallback_prefills"] or check["transfers_failed"]
    return not errors and not failed and not fell_back and all(x is not None for x in measured)
