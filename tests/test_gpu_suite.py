"""The GPU suite (benchmarks/gpu/): the bundle for the lent image builds and stays under its
size limit, and the CPU rehearsal runs every stage at smoke size in an environment built
the way the lent image is (a fresh venv holding only the image's packages, the bundle on
PYTHONPATH, no network where this machine can cut it), each stage writing its JSON. Also
the stage runner's time budgets: a step past its budget is stopped with every process it
started, detached ones included."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from splitserve.benchmarks.gpu import report, suite
from splitserve.benchmarks.gpu.image_env import build as build_image_env
from splitserve.benchmarks.gpu.manifest import carried, gpu_test_ids

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "benchmarks" / "gpu"
STAGE_FILES = {f"{s.number}_{s.name}.json" for s in suite.STAGES}


def bundle(dest: Path, python_version: str) -> str:
    proc = subprocess.run(["bash", str(GPU / "bundle.sh"), "--python-version", python_version, "--dest", str(dest)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def offline(argv: list[str]) -> list[str]:
    """``argv`` in a network namespace with only loopback, where this machine allows one."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return argv
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        return argv
    return ["unshare", "-n", "--", "bash", "-c", 'ip link set lo up && exec "$@"', "offline", *argv]


@pytest.mark.slow
def test_bundle_then_rehearsal(tmp_path):
    # the bundle for the lent image: CPython 3.12 wheels of every carried package, redis, the model's config
    printed = bundle(tmp_path / "whl312", "3.12")
    assert "of the 48 MiB limit" in printed
    wheels = sorted(p.name for p in (tmp_path / "whl312").glob("*.whl"))
    assert len(wheels) == len(carried())
    assert all("-cp312-" in w or "-py3-none-any" in w or "-abi3-" in w for w in wheels), wheels
    assert {p.name.split("_")[0] for p in (tmp_path / "whl312" / "deb").glob("*.deb")} >= {"redis-server", "redis-tools"}
    model = tmp_path / "whl312" / "model"
    assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()
    assert not list(model.glob("*.safetensors"))  # no weights travel

    # the rehearsal: the same bundle for this machine's Python, in the image-like venv
    bundle(tmp_path / "whl", f"{sys.version_info.major}.{sys.version_info.minor}")
    python = build_image_env(tmp_path / "venv")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "SPLITSERVE_"))}
    env.update(PYTHON=str(python), OMP_NUM_THREADS="1", PATH=os.defpath + ":" + env.get("PATH", ""))
    t0 = time.monotonic()
    proc = subprocess.run(offline(["bash", str(GPU / "suite.sh"), "--rehearse", "--bundle", str(tmp_path / "whl"),
                                   "--out", str(out)]), capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=1500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    print(f"rehearsal: {time.monotonic() - t0:.0f} s")

    files = {p.name for p in out.iterdir() if p.is_file()}
    assert files == STAGE_FILES | {"suite.log", "artifacts.tar.gz"}  # 8: what a device command brings back
    records = {name: json.loads((out / name).read_text()) for name in STAGE_FILES}
    for name, r in records.items():
        assert r["status"] == "ok" and r["rehearse"], (name, r["log_tail"][-20:])
        assert r["environment"]["device_name"] == "cpu" and r["environment"]["torch"]
        assert "suite.sh" in r["command"] and r["steps"] and all(s["command"] for s in r["steps"])
        assert isinstance(r["targets"], list)
        for t in r["targets"]:
            assert set(t) >= {"name", "value", "target", "op", "met"} and t["op"] in ("<=", ">=")

    probe = records["1_environment_tests.json"]["result"]["probe"]
    assert not any(probe["failed"].values()), probe["failed"]
    site = Path(probe["redis"]["path"]).parent.parent
    assert all(Path(c["path"]).is_relative_to(site) for c in probe["carried"].values())  # from the bundle
    assert probe["redis"]["answers"]
    tests = records["1_environment_tests.json"]["result"]["tests"]
    assert len(tests["tests"]) >= len(gpu_test_ids()) and tests["failed"] == 0  # every listed test collected
    assert tests["skipped"] == len(tests["tests"])  # no GPU here

    for name in STAGE_FILES - {"1_environment_tests.json"}:
        assert records[name]["result"] is not None, name  # the script's own JSON, embedded
    # serving ran the GPU stage's way: dummy weights on every node (smoke: of a tiny copy of the carried config)
    for setup in records["6_serving.json"]["result"]["rounds"][0].values():
        nodes = [a for name, a in setup["commands"].items() if not name.startswith("router")]
        assert nodes and all(a[a.index("--load-format") + 1] == "dummy" for a in nodes)
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        names = tar.getnames()
    assert "summary.json" in names and "junit.xml" in names and "serving.log" in names


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_step_past_its_budget_is_stopped_with_what_it_started(tmp_path):
    ctx = suite.Context(python=sys.executable, bundle=tmp_path, work=tmp_path, rehearse=True)
    pid_file = tmp_path / "child.pid"
    # the step starts a child in a session of its own (as the launcher starts nodes), then hangs
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(600)'], start_new_session=True); open({str(pid_file)!r}, 'w').write(str(p.pid)); "
              f"print('started', flush=True); time.sleep(600)")
    step = suite.Step("hang", [sys.executable, "-c", script], budget_s=suite.MIN_STEP_S, result=None)
    t0 = time.monotonic()
    run = suite.run_step(step, ctx, "test", seconds_left=100)
    assert run.status is suite.StageStatus.TIMED_OUT and run.returncode is None
    assert time.monotonic() - t0 < suite.MIN_STEP_S + 2 * suite.STOP_GRACE_S + 5
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and alive(child):
        time.sleep(0.1)
    assert not alive(child)
    assert "started" in (tmp_path / "hang.log").read_text()


def test_a_step_without_time_left_is_skipped_and_a_failure_is_recorded(tmp_path):
    ctx = suite.Context(python=sys.executable, bundle=tmp_path, work=tmp_path, rehearse=True)
    skipped = suite.run_step(suite.Step("late", [sys.executable, "-c", "pass"], 60, None), ctx, "t", seconds_left=3)
    assert skipped.status is suite.StageStatus.SKIPPED
    failed = suite.run_step(suite.Step("bad", [sys.executable, "-c", "raise SystemExit(3)"], 60, None), ctx, "t", 60)
    assert failed.status is suite.StageStatus.FAILED and failed.returncode == 3
    assert suite.stage_status([failed, skipped]) is suite.StageStatus.FAILED


def test_every_listed_gpu_test_exists():
    ids = gpu_test_ids()
    assert ids
    for node in ids:
        path = ROOT / node.split("::")[0]
        assert path.is_file(), node
        if "::" in node:
            assert f"def {node.split('::')[1].split('[')[0]}(" in path.read_text(), node


def test_the_gpu_page_shows_the_committed_gpu_results():  # docs/gpu.md, "GPU figures"
    assert report.main(["--check"]) == 0, "run: python -m splitserve.benchmarks.gpu.report"


def test_a_run_brought_back_is_taken_in_and_tabled(tmp_path):
    came_back, results = tmp_path / "files", tmp_path / "results"
    came_back.mkdir()
    record = {"stage": "3_engine", "status": "ok", "rehearse": False,
              "environment": {"device_name": "NVIDIA H100 80GB HBM3", "driver": "580.1"},
              "targets": [{"name": "bundled_decode_step_b1_ms", "value": 2.1, "target": 2.5, "op": "<=", "met": True},
                          {"name": "bundled_decode_tok_s", "value": 41000.0, "target": 50000, "op": ">=",
                           "met": False}]}
    (came_back / "3_engine.json").write_text(json.dumps(record))
    (came_back / "suite.log").write_text("log")
    (tmp_path / "kernels.png").write_bytes(b"\x89PNG")
    with tarfile.open(came_back / "artifacts.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "kernels.png", arcname="kernels.png")
    assert set(report.take(came_back, results)) == {"3_engine.json", "suite.log", "artifacts.tar.gz", "kernels.png"}
    text = report.table(report.records(results))
    assert "| 3_engine | `bundled_decode_step_b1_ms` | 2.1 | <= 2.5 | met | NVIDIA H100 80GB HBM3, driver 580.1 |" in text
    assert "| `bundled_decode_tok_s` | 41,000 | >= 50,000 | **missed** |" in text
    assert "| `llama3_8b_decode_step_over_floor` | - | <= 1.2 | not measured yet |" in text  # no stage reported it


@pytest.mark.parametrize("script", ["bench_kernels.py", "bench_gpu_engine.py", "bench_gpu_moe.py",
                                    "bench_gpu_serving.py"])
def test_a_gpu_script_without_cuda_says_so_and_writes_nothing(tmp_path, script):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "x.json"
    proc = subprocess.run([sys.executable, str(GPU / script), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout and not out.exists()


def test_a_stage_of_several_steps_reports_each_result_and_all_targets(tmp_path):
    """Stage 4: the Llama-3-8B step and the MoE step, each result under its label."""
    ctx = suite.Context(python=sys.executable, bundle=tmp_path, work=tmp_path, rehearse=False)
    stage = next(s for s in suite.STAGES if s.number == 4)
    steps = stage.steps(ctx)
    assert [s.label for s in steps] == ["engine_big", "moe"]
    assert "splitserve.benchmarks.gpu.bench_gpu_moe" in steps[1].argv
    row = {"name": "moe_decode_step_over_floor_qwen3-30b-a3b_b1", "value": 1.1, "target": 1.5, "op": "<=",
           "met": True}
    (tmp_path / "moe.json").write_text(json.dumps({"targets": [row]}))  # engine_big wrote nothing: cut short
    runs = [suite.StepRun(s.label, "x", suite.StageStatus.OK, 0, 1.0, s.budget_s) for s in steps]
    record = suite.stage_record(stage, steps, runs, ctx, {}, "suite.sh")
    assert record["stage"] == "4_big_models" and record["result"] == {"engine_big": None, "moe": {"targets": [row]}}
    assert record["targets"] == [row]


def test_the_budgets_add_up_to_the_deadline():
    labels = [s.label for stage in suite.STAGES for s in stage.steps(suite.Context("python", Path("."), Path("."),
                                                                                   False))]
    assert sorted(labels) == sorted(suite.BUDGET_S)
    assert sum(suite.BUDGET_S[label][0] for label in labels) <= suite.DEADLINE_S[False] < 600
