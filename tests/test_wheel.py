"""The wheel built from the checkout, installed as a user would (not editable) into a
fresh venv whose only other packages are the project venv's (a .pth file pointing at its
site-packages; no checkout on sys.path, run from an empty folder): every command of
``splitserve`` (enumerated from its argparse parser) answers --help through the console
script, every module of the package imports, the data files the code reads at run time
are there, and every file a package-data glob matches in the checkout is installed."""

import json
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# not part of the source a wheel is built from (local state, caches, results)
IGNORED = shutil.ignore_patterns(".venv", ".git", "__pycache__", "build", "*.egg-info", ".mypy_cache",
                                 ".pytest_cache", ".whl", "results")

# Run inside the fresh venv: what it prints is checked below.
PROBE = r'''
import argparse, importlib, json, pkgutil, sys, tomllib
from pathlib import Path
import splitserve
from splitserve.cli import build_parser

sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
failed = {}
modules = [m.name for m in pkgutil.walk_packages(splitserve.__path__, "splitserve.")]
for name in modules:
    try:
        importlib.import_module(name)
    except BaseException as e:
        failed[name] = repr(e)[:300]
from splitserve.benchmarks.gpu import bench_gpu_engine, manifest
from splitserve.deploy.planner import sim_profiles
from splitserve.deploy.launcher import DEFAULT_CONFIG
reads = {
    "deploy/local.toml": "cluster" in tomllib.loads(DEFAULT_CONFIG.read_text()),
    "deploy/planner/sim_profiles.toml": sim_profiles.PROFILES_FILE.is_file(),
    "benchmarks/gpu lists": bool(manifest.carried()),
    "benchmarks/model_configs": (bench_gpu_engine.CONFIGS / "llama3-8b" / "config.json").is_file(),
}
print(json.dumps({"package": splitserve.__file__, "commands": sorted(sub.choices), "modules": modules,
                  "failed": failed, "reads": reads}))
'''


def test_the_wheel_installs_and_every_command_and_module_works(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORED)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(src)], check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("splitserve-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # dependencies only
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                    str(wheel)], check=True, capture_output=True, timeout=600)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONNOUSERSITE": "1"}
    probe = subprocess.run([str(python), "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=600)
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.splitlines()[-1])
    assert Path(seen["package"]).is_relative_to(site), seen["package"]  # the wheel's, not the checkout
    assert not seen["failed"], seen["failed"]
    assert all(seen["reads"].values()), seen["reads"]
    assert not any(m.startswith("splitserve.tests") for m in seen["modules"])
    assert {"splitserve.deploy.planner", "splitserve.deploy.planner.offline"} <= set(seen["modules"])
    assert "up" in seen["commands"] and "router" in seen["commands"]
    for command in [[], *([c] for c in seen["commands"])]:
        out = subprocess.run([str(venv / "bin" / "splitserve"), *command, "--help"], cwd=cwd, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "usage: splitserve" in out.stdout, (command, out.stderr[-2000:])
    # the simulated-node profiles ship beside their module (deploy/planner/sim_profiles.toml)
    out = subprocess.run([str(venv / "bin" / "splitserve"), "sim-nodes", "--list-profiles"], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "llama3-8b-h100" in out.stdout, out.stderr[-2000:]
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package, globs in package_data.items():
        folder = ROOT.joinpath(*package.split(".")[1:])
        for pattern in globs:
            for f in folder.glob(pattern):
                assert (site / package.replace(".", "/") / f.relative_to(folder)).is_file(), f
