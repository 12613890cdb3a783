"""The GPU suite's first step: what this machine runs, whether the carried bundle is
complete, and the one-time build of the CUDA kernels, as one JSON record.

    python -m splitserve.benchmarks.gpu.probe --out probe.json [--rehearse]

Records the device name, driver, CUDA, torch, triton, transformers and Python versions
(every stage's JSON carries them), checks what the suite relies on and lists each failed
check in ``failed``: the carried packages import from the bundle's folder at the bundled
versions, redis-server starts and answers, the bundled model's config and tokenizer are
there, and (on a GPU) CUDA is usable and the csrc kernels build. ``failed`` maps a kind of
check (FAILURE_KINDS) to what failed; the suite stops on a ``bundle`` or ``device``
failure (nothing after would run), and goes on after an ``image`` or ``csrc`` one (the
tests say what it breaks; the benchmarks fall back to the Triton kernels). Exit status
0 when nothing failed, 1 otherwise; the JSON is written either way.
"""

import argparse
import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from splitserve.benchmarks.gpu.contract import environment as contract_environment
from splitserve.benchmarks.gpu.manifest import carried

FAILURE_KINDS = ("device", "bundle", "image", "csrc")
# packages of the lent image the suite relies on, and the oldest version it was written against
IMAGE_MINIMUM = {"torch": "2.11", "triton": "3.6", "transformers": "5.17", "numpy": "2.0", "aiohttp": "3.9",
                 "safetensors": "0.4", "tokenizers": "0.21", "pytest": "8.0", "pytest-timeout": "2.3"}


def _command(argv: list[str], line: int = 0, timeout: float = 20) -> str | None:
    """Line ``line`` of a command's output, or None when it is missing or fails."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[line].strip() if out.returncode == 0 and lines else None


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split("+")[0].split("."):
        digits = "".join(c for c in p if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def environment() -> dict:
    """Device, driver and versions (contract.environment, and more of the device and the
    toolchain): the record every stage's JSON carries."""
    import torch

    env = contract_environment("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device_memory_gib=round(props.total_memory / 2**30, 1), sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}")
    env.update(nvcc=_command(["nvcc", "--version"], line=-1), cpus=os.cpu_count())
    for dist in ("transformers", "numpy"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    return env


def check_image(failed: list[str]) -> dict:
    """Versions of the image's packages the suite relies on."""
    got: dict[str, str | None] = {}  # dist -> version; None: not installed
    for dist, minimum in IMAGE_MINIMUM.items():
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            got[dist] = None
            failed.append(f"{dist} is not installed (the suite needs >= {minimum})")
            continue
        got[dist] = version
        if _version_tuple(version) < _version_tuple(minimum):
            failed.append(f"{dist} {version} is older than {minimum}")
    return got


def check_carried(bundle: Path, failed: list[str]) -> dict:
    """Each carried package imports from the suite's folder at the bundled version."""
    site = Path(os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or ".").resolve()
    wheels = {w.name.split("-")[0].lower(): w.name.split("-")[1] for w in bundle.glob("*.whl")}
    got = {}
    for dist, module in carried():
        want = wheels.get(dist.replace("-", "_"))
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # an incomplete bundle shows up here, not as a stage crash later
            failed.append(f"{module} does not import ({type(e).__name__}: {e})")
            got[module] = {"error": str(e)}
            continue
        where = Path(mod.__file__ or "").resolve()
        version = importlib.metadata.version(dist)
        got[module] = {"version": version, "path": str(where)}
        if site not in where.parents:
            failed.append(f"{module} imports from {where}, not from the bundle's {site}")
        if want is not None and version != want:
            failed.append(f"{module} is {version}, the bundle carries {want}")
    return got


def check_redis(failed: list[str]) -> dict:
    from splitserve.deploy.launcher import start_redis

    out: dict[str, str | bool | None] = {"path": shutil.which("redis-server"),
                                         "version": _command(["redis-server", "--version"])}
    try:
        proc, _ = start_redis()
        proc.kill()
        proc.wait()
        out["answers"] = True
    except RuntimeError as e:
        out["answers"] = False
        failed.append(f"redis-server: {e}")
    return out


def build_kernels(failed: list[str]) -> dict:
    """The one-time csrc build (later stages and tests reuse it)."""
    import torch

    if not torch.cuda.is_available():
        return {"built": False, "why": "no CUDA device"}
    from splitserve.csrc.build import CsrcBuildError, load_ops

    t0 = time.monotonic()
    try:
        load_ops()
    except CsrcBuildError as e:
        failed.append(f"csrc: {e}")
        return {"built": False, "why": str(e), "seconds": round(time.monotonic() - t0, 1)}
    return {"built": True, "seconds": round(time.monotonic() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--bundle", required=True, help="the carried folder (.whl)")
    ap.add_argument("--rehearse", action="store_true", help="CPU: no CUDA expected")
    args = ap.parse_args(argv)
    failed: dict[str, list[str]] = {kind: [] for kind in FAILURE_KINDS}
    record: dict = {"environment": environment()}
    import torch

    if not args.rehearse and not torch.cuda.is_available():
        failed["device"].append("torch.cuda.is_available() is False: no usable GPU (the GPU stages need one)")
    record["image_packages"] = check_image(failed["image"])
    record["carried"] = check_carried(Path(args.bundle), failed["bundle"])
    record["redis"] = check_redis(failed["bundle"])
    model = Path(args.bundle) / "model"
    for name in ("config.json", "tokenizer.json"):
        if not (model / name).is_file():
            failed["bundle"].append(f"the bundled model's {name} is missing from {model} (bundle.sh copies it)")
    record["csrc"] = build_kernels(failed["csrc"])
    record["failed"] = failed
    Path(args.out).write_text(json.dumps(record, indent=2))
    env = record["environment"]
    print(f"{env['device_name']} (driver {env['driver']}), Python {env['python']}, torch {env['torch']} "
          f"(CUDA {env['cuda']}), triton {env['triton']}, transformers {env['transformers']}, nvcc {env['nvcc']}")
    versions = (f"{module} {got.get('version', 'missing')}" for module, got in record["carried"].items())
    print(f"carried: {', '.join(versions)}")
    print(f"redis-server: {record['redis']['version']} at {record['redis']['path']}, "
          f"answers: {record['redis'].get('answers')}; csrc: {record['csrc']}")
    for kind, what in failed.items():
        for line in what:
            print(f"FAILED ({kind}): {line}")
    return 1 if any(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
