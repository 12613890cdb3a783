"""The GPU suite: every GPU measurement in one command, each stage under its own time
budget, each writing its JSON as soon as it ends. Run it through suite.sh, which makes the
environment (the carried wheels, redis-server, the package) and says how to call it.

    stage                GPU budget  what
    1 environment_tests  90 + 110 s  the probe (versions, the bundle, redis, the csrc build),
                                     then the gpu tests listed in gpu_tests.txt
    2 kernels                 35 s   paged decode attention bandwidth, 512..32k context, vs SDPA
    3 engine                  90 s   the bundled shape in bf16 on random weights: batch-1 step
                                     (static async, static_sync, eager), tok/s at batch 64/256,
                                     prefill tok/s, each beside transformers
    4 big_models         60 + 60 s   the Llama-3-8B shape, dummy weights, vs the weight-read floor;
                                     then the MoE shapes (Qwen3-30B-A3B, Mixtral-8x7B if it fits)
                                     at batch 1 and 64 vs the floor of the experts read
    5 transfer                30 s   KV transfer from device memory (ipc, tcp staged) vs a copy
    6 serving                100 s   1 prefill + 1 decode (ipc) vs decode --colocated, one GPU

The budgets add up to the deadline (575 s), inside a device command's 600 s; most steps
should end well before theirs (estimates before the MoE step: the whole suite 7.5 to 9
minutes on an H100; its 60 s were taken from the tests, kernels and serving budgets, none
of them measured yet). A stage of several steps with results reports {label: result} and
all their targets.

A step that outlives its budget, or the suite's deadline (``--deadline-s``, counted from
suite.sh's start), is stopped with every process it started (found by a marker in their
environment: nodes and redis start sessions of their own), recorded as timed out, and the
next stage runs. The probe always runs first (its record is every stage's environment);
a broken bundle or no GPU stops the suite there.

Files in ``--out``, 8 at most (what a device command brings back): ``<n>_<stage>.json``
each {"stage", "status" (StageStatus), "seconds", "budget_s", "steps", "environment",
"command", "result" (the script's own JSON, partial if it was stopped), "targets"
(its pass/fail list), "log_tail"}; ``suite.log`` (written by suite.sh); and
``artifacts.tar.gz``: the scripts' plots, full logs, the tests' junit XML and summary.json.
"""

from __future__ import annotations

import argparse
import enum
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, NamedTuple

from splitserve.benchmarks.gpu.manifest import gpu_test_ids

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = {False: 575, True: 1500}  # rehearse -> seconds from suite.sh's start; a device command gets 600
# step label -> (GPU budget, rehearsal budget), seconds
BUDGET_S = {"probe": (90, 60), "tests": (110, 150), "kernels": (35, 120), "engine_bundled": (90, 120),
            "engine_big": (60, 120), "moe": (60, 120), "transfer": (30, 120), "serving": (100, 300)}
TEST_TIMEOUT_S = 60  # per gpu test (pytest-timeout): a hang fails that test, not the stage
MIN_STEP_S = 15  # a step given less than this is skipped rather than started
STOP_GRACE_S = 5  # SIGTERM, then SIGKILL
LOG_TAIL_LINES = 60
ARTIFACT_LOG_BYTES = 2 << 20  # the end of each log kept in artifacts.tar.gz
MARKER = "SPLITSERVE_SUITE_STEP"  # env var naming the step that started a process


class StageStatus(enum.Enum):
    OK = "ok"
    FAILED = "failed"  # a step exited non-zero
    TIMED_OUT = "timed_out"  # a step outlived its budget or the deadline and was stopped
    SKIPPED = "skipped"  # too little time was left to start it


class Step(NamedTuple):
    label: str
    argv: list[str]
    budget_s: float
    result: Path | None  # the JSON the step writes, None when it writes none


class StepRun(NamedTuple):
    label: str
    command: str
    status: StageStatus
    returncode: int | None
    seconds: float
    budget_s: float


class Context(NamedTuple):
    python: str
    bundle: Path
    work: Path  # the scripts' own outputs (JSON, plots, logs)
    rehearse: bool


class Stage(NamedTuple):
    number: int
    name: str
    steps: Callable[[Context], list[Step]]


def budget(label: str, ctx: Context) -> float:
    return BUDGET_S[label][ctx.rehearse]


def _script(ctx: Context, module: str, *args: str) -> list[str]:
    return [ctx.python, "-m", f"splitserve.benchmarks.{module}", *args]


def probe_step(ctx: Context) -> Step:
    argv = _script(ctx, "gpu.probe", "--bundle", str(ctx.bundle), "--out", str(ctx.work / "probe.json"))
    return Step("probe", argv + (["--rehearse"] if ctx.rehearse else []), budget("probe", ctx),
                ctx.work / "probe.json")


def _tests(ctx: Context) -> list[Step]:
    argv = [ctx.python, "-m", "pytest", "-v", "-p", "timeout", "--timeout", str(TEST_TIMEOUT_S), "-p",
            "no:cacheprovider", "-m", "gpu", "--junitxml", str(ctx.work / "junit.xml"), *gpu_test_ids()]
    return [probe_step(ctx), Step("tests", argv, budget("tests", ctx), None)]


def _kernels(ctx: Context) -> list[Step]:
    out = ctx.work / "kernels.json"
    size = ["--smoke"] if ctx.rehearse else ["--quick"]
    return [Step("kernels", _script(ctx, "gpu.bench_kernels", *size, "--out", str(out)), budget("kernels", ctx), out)]


def _engine(part: str) -> Callable[[Context], list[Step]]:
    def steps(ctx: Context) -> list[Step]:
        out = ctx.work / f"engine_{part}.json"
        size = ["--model-dir", str(ctx.bundle / "model")] if part == "bundled" else []
        argv = _script(ctx, "gpu.bench_gpu_engine", "--part", part, *size, *(["--smoke"] if ctx.rehearse else []),
                       "--out", str(out))
        return [Step(f"engine_{part}", argv, budget(f"engine_{part}", ctx), out)]
    return steps


def _big_models(ctx: Context) -> list[Step]:
    """The Llama-3-8B shape (bench_gpu_engine --part big), then the MoE shapes (bench_gpu_moe)."""
    out = ctx.work / "moe.json"
    argv = _script(ctx, "gpu.bench_gpu_moe", *(["--smoke"] if ctx.rehearse else []), "--out", str(out))
    return _engine("big")(ctx) + [Step("moe", argv, budget("moe", ctx), out)]


def _transfer(ctx: Context) -> list[Step]:
    out = ctx.work / "transfer.json"
    size = ["--smoke"] if ctx.rehearse else ["--runs", "5"]
    return [Step("transfer", _script(ctx, "gpu.bench_gpu_transfer", *size, "--out", str(out)),
                 budget("transfer", ctx), out)]


def _serving(ctx: Context) -> list[Step]:
    out = ctx.work / "serving.json"
    model = ["--model", str(ctx.bundle / "model"), "--load-format", "dummy"]
    size = ["--smoke"] if ctx.rehearse else ["--rounds", "1", "--ttft-requests", "8", "--short", "96", "--long", "6"]
    return [Step("serving", _script(ctx, "gpu.bench_gpu_serving", *model, *size, "--out", str(out)),
                 budget("serving", ctx), out)]


STAGES = (Stage(1, "environment_tests", _tests), Stage(2, "kernels", _kernels),
          Stage(3, "engine", _engine("bundled")), Stage(4, "big_models", _big_models),
          Stage(5, "transfer", _transfer), Stage(6, "serving", _serving))


# ---- running a step ----------------------------------------------------------------------

def _marked(token: str) -> list[int]:
    """Processes whose environment names ``token`` as their step (this process excluded)."""
    needle = f"{MARKER}={token}\0".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def stop_marked(token: str) -> int:
    """SIGTERM every process of the step, SIGKILL what is left after STOP_GRACE_S; how many."""
    pids = _marked(token)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while sig == signal.SIGTERM and time.monotonic() < deadline and _marked(token):
            time.sleep(0.2)
        pids = _marked(token)
        if not pids:
            break
    return len(pids)


def clear_build_locks() -> None:
    """Removes the lock a csrc build stopped midway leaves (torch's extension builder would
    wait on it forever in the next stage); the next load resumes the build where it was."""
    from splitserve.common.bundled import cache_root

    for lock in (cache_root() / "torch_extensions").glob("*/lock"):
        lock.unlink(missing_ok=True)
        print(f"[suite] removed {lock}, left by a stopped csrc build", flush=True)


def run_step(step: Step, ctx: Context, run_id: str, seconds_left: float) -> StepRun:
    """Runs ``step`` for at most its budget and ``seconds_left``, its output prefixed on stdout
    and kept in ``<work>/<label>.log``."""
    budget = min(step.budget_s, seconds_left)
    command = shlex.join(step.argv)
    if budget < MIN_STEP_S:
        print(f"[suite] {step.label}: skipped, {seconds_left:.0f} s left of the deadline", flush=True)
        return StepRun(step.label, command, StageStatus.SKIPPED, None, 0.0, budget)
    print(f"[suite] {step.label}: {command} (budget {budget:.0f} s)", flush=True)
    token = f"{run_id}-{step.label}"
    env = dict(os.environ, **{MARKER: token})
    t0 = time.monotonic()
    with open(ctx.work / f"{step.label}.log", "w") as log:
        proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                sys.stdout.write(f"[{step.label}] {line}")
                sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            returncode: int | None = proc.wait(timeout=budget)
            status = StageStatus.OK if returncode == 0 else StageStatus.FAILED
        except subprocess.TimeoutExpired:
            returncode, status = None, StageStatus.TIMED_OUT
        left = stop_marked(token)  # the step itself when it timed out; nodes and redis it left behind
        proc.wait()
        reader.join(timeout=10)
    if status is StageStatus.TIMED_OUT:
        clear_build_locks()
    seconds = time.monotonic() - t0
    extra = f", {left} processes would not stop" if left else ""
    print(f"[suite] {step.label}: {status.value} after {seconds:.0f} s (exit {returncode}){extra}", flush=True)
    return StepRun(step.label, command, status, returncode, round(seconds, 1), round(budget, 1))


# ---- results -----------------------------------------------------------------------------

def read_json(path: Path | None) -> dict | None:
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # cut off while writing


def junit_summary(path: Path) -> dict | None:
    """{"passed", "failed", "skipped", "tests": [{"id", "outcome", "seconds", "message"}]}."""
    if not path.is_file():
        return None
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                message = (child.get("message") or "").splitlines()[0][:300] if child.get("message") else ""
        tests.append({"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0), 2), "message": message})
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    return {**counts, "tests": tests}


def stage_status(runs: list[StepRun]) -> StageStatus:
    statuses = {r.status for r in runs}
    for s in (StageStatus.TIMED_OUT, StageStatus.FAILED, StageStatus.SKIPPED):
        if s in statuses:
            return s
    return StageStatus.OK


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    if not path.is_file():
        return []
    return path.read_text(errors="replace").splitlines()[-lines:]


def stage_record(stage: Stage, steps: list[Step], runs: list[StepRun], ctx: Context, environment: dict,
                 command: str) -> dict:
    results = {s.label: read_json(s.result) for s in steps if s.result is not None}
    if stage.number == 1:
        tests = junit_summary(ctx.work / "junit.xml")
        result: dict | None = {"probe": results.get("probe"), "tests": tests}
        targets = [] if ctx.rehearse or tests is None else [
            {"name": "gpu_tests_pass", "value": tests["passed"], "target": len(tests["tests"]) - tests["skipped"],
             "op": ">=", "met": tests["failed"] == 0 and tests["passed"] > 0}]
    else:
        result = next(iter(results.values()), None) if len(results) == 1 else results
        targets = [t for r in results.values() for t in (r or {}).get("targets", [])]
    return {"stage": f"{stage.number}_{stage.name}", "status": stage_status(runs).value,
            "seconds": round(sum(r.seconds for r in runs), 1), "budget_s": sum(r.budget_s for r in runs),
            "steps": [r._asdict() | {"status": r.status.value} for r in runs], "environment": environment,
            "command": command, "rehearse": ctx.rehearse, "result": result, "targets": targets,
            "log_tail": [line for r in runs for line in tail(ctx.work / f"{r.label}.log")]}


def write_artifacts(out: Path, work: Path, summary: list[dict]) -> None:
    """artifacts.tar.gz: plots, the end of each log, junit XML and the summary (rewritten after
    every stage, so a suite stopped midway still brings back what it had)."""
    tmp = out / "artifacts.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(work.iterdir()):
            if path.suffix in (".png", ".xml"):
                tar.add(path, arcname=path.name)
            elif path.suffix == ".log":
                data = path.read_bytes()[-ARTIFACT_LOG_BYTES:]
                info = tarfile.TarInfo(path.name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        data = json.dumps(summary, indent=2).encode()
        info = tarfile.TarInfo("summary.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    tmp.replace(out / "artifacts.tar.gz")


def summary_line(record: dict) -> dict:
    return {"stage": record["stage"], "status": record["status"], "seconds": record["seconds"],
            "targets": [{k: t.get(k) for k in ("name", "value", "op", "target", "met")} for t in record["targets"]]}


def print_summary(summary: list[dict]) -> None:
    print("\n[suite] summary", flush=True)
    for s in summary:
        print(f"  {s['stage']:<20} {s['status']:<10} {s['seconds']:>6.0f} s", flush=True)
        for t in s["targets"]:
            verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
            print(f"      {t['name']:<48} {t['value']!s:>12} {t['op']} {t['target']!s:<10} {verdict}", flush=True)


# ---- the suite ---------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where the stage JSONs go ($OUT on a device machine)")
    ap.add_argument("--bundle", default=str(ROOT / ".whl"))
    ap.add_argument("--rehearse", action="store_true", help="CPU, smoke sizes: proves every stage starts and writes")
    ap.add_argument("--stages", default=None, help="comma-separated stage numbers (default: all)")
    ap.add_argument("--deadline-s", type=float, default=None, help="from --started-at; default 570 (1500 rehearse)")
    ap.add_argument("--started-at", type=float, default=None, help="epoch seconds suite.sh started")
    a = ap.parse_args(argv)
    started = a.started_at or time.time()
    deadline = started + (a.deadline_s or DEADLINE_S[a.rehearse])
    out = Path(a.out)
    work = out / ".work" if a.rehearse else Path(os.environ.get("TMPDIR", "/tmp")) / f"splitserve-suite-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(python=sys.executable, bundle=Path(a.bundle).resolve(), work=work, rehearse=a.rehearse)
    wanted = {int(n) for n in a.stages.split(",")} if a.stages else {s.number for s in STAGES}
    run_id = f"{os.getpid()}-{int(started)}"
    command = shlex.join(["bash", "benchmarks/gpu/suite.sh", *(argv if argv is not None else sys.argv[1:])])

    probe = run_step(probe_step(ctx), ctx, run_id, deadline - time.time())
    found = read_json(ctx.work / "probe.json") or {}
    environment = found.get("environment", {})
    fatal = [f for kind in ("bundle", "device") for f in found.get("failed", {}).get(kind, [])]
    if probe.status is not StageStatus.OK and not found:
        fatal.append(f"the probe did not finish ({probe.status.value}, exit {probe.returncode})")
    summary = []
    for stage in STAGES:
        if stage.number not in wanted or fatal:
            continue
        steps = stage.steps(ctx)
        runs = [probe if s.label == "probe" else run_step(s, ctx, run_id, deadline - time.time()) for s in steps]
        record = stage_record(stage, steps, runs, ctx, environment, command)
        (out / f"{record['stage']}.json").write_text(json.dumps(record, indent=2) + "\n")
        summary.append(summary_line(record))
        write_artifacts(out, work, summary)
    if fatal:
        record = {"stage": "1_environment_tests", "status": StageStatus.FAILED.value, "seconds": probe.seconds,
                  "environment": environment,
                  "command": command, "result": {"probe": found}, "fatal": fatal, "targets": [],
                  "log_tail": tail(ctx.work / "probe.log")}
        (out / "1_environment_tests.json").write_text(json.dumps(record, indent=2) + "\n")
        print("[suite] stopped before the stages:\n  " + "\n  ".join(fatal), flush=True)
        write_artifacts(out, work, [summary_line(record)])
        return 2
    print_summary(summary)
    return 0 if all(s["status"] == StageStatus.OK.value for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
