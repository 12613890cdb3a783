"""Takes in what a GPU suite run brought back and shows it: the stage JSONs land in
benchmarks/results/gpu/ (with the plots from artifacts.tar.gz), and the table of GPU
figures in docs/gpu.md is rewritten from them, each issue target met, missed or not measured.

    python -m splitserve.benchmarks.gpu.report --take DIR   # DIR: the device call's files
    python -m splitserve.benchmarks.gpu.report              # rewrite docs/gpu.md's table only
    python -m splitserve.benchmarks.gpu.report --check      # exit 1 when docs/gpu.md is stale

Reads only; never measures. The table sits between TABLE_BEGIN and TABLE_END.
"""

import argparse
import json
import shutil
import sys
import tarfile
from pathlib import Path

from splitserve.benchmarks.gpu.contract import TARGETS

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "gpu"
PAGE = ROOT / "docs" / "gpu.md"  # the GPU page, "GPU figures"
TABLE_BEGIN = "<!-- gpu-figures: written by python -m splitserve.benchmarks.gpu.report -->"
TABLE_END = "<!-- /gpu-figures -->"
VERDICT = {True: "met", False: "**missed**", None: "not measured"}


def records(results: Path = RESULTS) -> list[dict]:
    """The stage JSONs of the last GPU suite run, in stage order (rehearsals left out)."""
    found = []
    for path in sorted(results.glob("[0-9]_*.json")):
        record = json.loads(path.read_text())
        if not record.get("rehearse"):
            found.append(record)
    return found


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.3g}" if isinstance(value, float) and abs(value) < 100 else f"{value:,.0f}"


def table(found: list[dict]) -> str:
    """Markdown: one row per target the stages reported, then each issue target no stage
    reported as not measured."""
    lines = ["| stage | target | measured | goal | verdict | device |", "|---|---|---|---|---|---|"]
    reported: set[str] = set()  # TARGETS kinds some stage reported
    for r in found:
        env = r.get("environment", {})
        device = f"{env.get('device_name', '?')}, driver {env.get('driver', '?')}"
        if not r["targets"]:
            lines.append(f"| {r['stage']} | ({r['status']}) | | | | {device} |")
        for t in r["targets"]:
            reported.update(kind for kind in TARGETS if t["name"].startswith(kind))
            lines.append(f"| {r['stage']} | `{t['name']}` | {_fmt(t['value'])} | {t['op']} {_fmt(t['target'])} | "
                         f"{VERDICT[t['met']]} | {device} |")
    for kind, t in TARGETS.items():
        if kind not in reported:
            lines.append(f"| - | `{kind}` | - | {t.op} {_fmt(t.target)} | not measured yet | no GPU run |")
    return "\n".join(lines)


def page_with(text: str, body: str) -> str:
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n{body}\n{TABLE_END}{tail}"


def take(src: Path, results: Path = RESULTS) -> list[str]:
    """Copies a run's stage JSONs and suite.log into ``results``, and the plots out of its
    artifacts.tar.gz; the names taken."""
    results.mkdir(parents=True, exist_ok=True)
    taken = []
    for path in sorted(src.iterdir()):
        if path.name.endswith(".json") or path.name in ("suite.log", "artifacts.tar.gz"):
            shutil.copy(path, results / path.name)
            taken.append(path.name)
    archive = src / "artifacts.tar.gz"
    if archive.is_file():
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".png") and "/" not in member.name:
                    tar.extract(member, results, filter="data")
                    taken.append(member.name)
    return taken


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--take", type=Path, default=None, help="the folder a device call's files came back in")
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/gpu.md's table is not the results'")
    a = ap.parse_args(argv)
    if a.take:
        print("took " + ", ".join(take(a.take)))
    text = PAGE.read_text()
    new = page_with(text, table(records()))
    if a.check:
        if new != text:
            print("docs/gpu.md's GPU figures differ from benchmarks/results/gpu/: run "
                  "python -m splitserve.benchmarks.gpu.report", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    print(table(records()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
