"""``splitserve plan``'s output: the table on stdout, the JSON and the plot of cost
against attainment (every configuration tried; the chosen one ringed). Must not search."""

from __future__ import annotations

import json
from pathlib import Path

from ..slo import Slo
from .search import Candidate, PlanResult


def as_dict(c: Candidate) -> dict:
    return {**c._asdict(), "label": c.label(), "worst": c.worst}


def format_plan(result: PlanResult, slo: Slo, workload: dict) -> str:
    head = (f"workload: {workload['requests']} requests over {workload['span_s']} s, "
            f"{workload['rate_per_s']} req/s, input {workload['mean_input_tokens']} / output "
            f"{workload['mean_output_tokens']} tokens on average\nSLO: {slo.describe()}")
    shown = ([result.best] if result.best else []) + result.alternatives
    w = max([40] + [len(c.label()) for c in shown])
    rows = [head, f"{'':2}{'fleet':{w}} {'devices':>7} {'TTFT ok':>8} {'ITL ok':>7} {'TTFT q':>8} "
                  f"{'ITL q':>8} {'P util':>7} {'D util':>7}"]
    for i, c in enumerate(shown):
        mark = "* " if result.best is not None and i == 0 else "  "
        rows.append(f"{mark}{c.label():{w}} {c.devices:>7} {c.ttft_ok:>8.1%} {c.itl_ok:>7.1%} "
                    f"{c.ttft_q_s:>7.3f}s {c.itl_q_s * 1000:>6.1f}ms {c.prefill_util:>7.1%} {c.decode_util:>7.1%}")
    if result.best is None:
        rows.append("no configuration tried meets the SLO: the best near misses are listed; raise --max-nodes "
                    "or relax the SLO")
    else:
        rows.append(f"* the cheapest that meets the SLO: {result.best.label()}, {result.best.devices} devices "
                    f"({len(result.evaluated)} configurations modelled)")
    return "\n".join(rows)


def write(result: PlanResult, slo: Slo, summary: dict, path: str | Path) -> dict:
    """The JSON at ``path`` and the plot beside it (``.png``); the JSON's content."""
    out = {**summary, "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s, "attainment": slo.attainment},
           "best": as_dict(result.best) if result.best else None,
           "alternatives": [as_dict(c) for c in result.alternatives],
           "evaluated": [as_dict(c) for c in result.evaluated]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    plot(result, slo, path.with_suffix(".png"), summary.get("title", ""))
    return out


def plot(result: PlanResult, slo: Slo, path: Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in result.evaluated:
        ax.scatter(c.devices, c.ttft_ok * 100, marker="o", color="tab:blue", alpha=0.6,
                   label="TTFT attainment" if c is result.evaluated[0] else None)
        ax.scatter(c.devices, c.itl_ok * 100, marker="s", color="tab:orange", alpha=0.6,
                   label="ITL attainment" if c is result.evaluated[0] else None)
    if result.best is not None:
        b = result.best
        ax.scatter([b.devices], [b.worst * 100], s=250, facecolors="none", edgecolors="k",
                   label=f"chosen {b.label()}")
    ax.axhline(slo.attainment * 100, color="gray", linestyle="--", label=f"target {slo.attainment:.0%}")
    ax.set_xlabel("devices (cost)")
    ax.set_ylabel("requests within the SLO (%)")
    ax.set_ylim(0, 102)
    ax.set_title(title or "plan: cost against attainment")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
