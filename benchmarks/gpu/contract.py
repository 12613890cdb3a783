"""What every GPU benchmark's JSON holds at its top level (bench_kernels, bench_gpu_engine,
bench_gpu_moe, bench_gpu_transfer, bench_gpu_serving), and the issue's targets, in this one place:

    "environment": {"device", "device_name", "driver", "torch", "cuda", "triton", "python",
                    "host", "command"}
    "targets": [{"name": "bundled_decode_step_b1_ms", "value": 1.9, "target": 2.5, "op": "<=",
                 "met": true}, ...]

A row's name is its target's kind plus the sizes it was measured at (a --smoke run's
rows carry the smoke sizes, so no row passes for a figure it is not). ``value`` None
(a part not reached: the stage was cut short, a setup failed) gives ``met`` None.
``write_json`` replaces the file whole, so a stage killed mid-write leaves the last
complete version. Must not measure anything or import torch at module level.
"""

import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import NamedTuple


class Target(NamedTuple):
    op: str  # "<=" or ">="
    target: float
    meaning: str


# kind -> the target (one H100, bf16)
TARGETS = {
    "paged_attention_pct_of_copy": Target(">=", 80.0, "paged decode attention (the backend --attention-backend "
                                          "auto picks on CUDA) K/V bandwidth as % of the measured device copy, at "
                                          "32k context and the largest batch measured"),
    "paged_attention_speedup_vs_sdpa": Target(">=", 1.0, "SDPA over pre-gathered K/V time / the kernel's time at "
                                              "512 tokens, the lowest over every batch measured"),
    "bundled_decode_step_b1_ms": Target("<=", 2.5, "bundled model, static decode step at batch 1 (ms)"),
    "bundled_decode_tok_s": Target(">=", 50000, "bundled model, output tok/s at batch 256"),
    "bundled_prefill_tok_s": Target(">=", 50000, "bundled model, prefill tok/s: the lowest of the 2048-token "
                                    "batches (1x2048, 4x512, 16x128)"),
    "llama3_8b_decode_step_over_floor": Target("<=", 1.2, "Llama-3-8B shape (dummy weights), static decode step at "
                                               "batch 1 / weight bytes over the measured copy bandwidth"),
    "moe_decode_step_over_floor": Target("<=", 1.5, "MoE shapes (Qwen3-30B-A3B, Mixtral-8x7B; dummy weights), "
                                         "static decode step at batch 1 and 64 / the bytes of the dense weights and "
                                         "of the experts the step's routing read, over the measured copy bandwidth"),
    "ttft_p50_disagg_over_colocated": Target("<=", 1.10, "TTFT p50, 1 prefill + 1 decode node (ipc) / one colocated "
                                             "node, per prompt length (2048, 8000)"),
    "short_tpot_p99_disagg_over_colocated": Target("<=", 0.5, "TPOT p99 of short requests while long prompts "
                                                   "prefill, disaggregated / colocated"),
}


def target_row(kind: str, value: float | None, sizes: str = "") -> dict:
    """One ``targets`` entry of ``kind`` (a TARGETS key); ``sizes`` is appended to its name."""
    t = TARGETS[kind]
    met = None if value is None else (value <= t.target if t.op == "<=" else value >= t.target)
    return {"name": f"{kind}_{sizes}" if sizes else kind, "value": value, "target": t.target, "op": t.op, "met": met}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict:
    """Where and how this run happened; ``device`` as the script used it (cpu, cuda, cuda:1)."""
    import torch

    env = {"device": device, "device_name": "cpu", "driver": None, "torch": torch.__version__,
           "cuda": torch.version.cuda, "triton": _version("triton"), "python": platform.python_version(),
           "host": platform.node(), "command": " ".join([sys.executable, *sys.argv])}
    if device.startswith("cuda"):
        env["device_name"] = torch.cuda.get_device_name(device)
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            env["driver"] = out.stdout.split()[0]
        except (OSError, IndexError, subprocess.SubprocessError) as e:
            env["driver"] = f"unknown ({e})"
    return env


def write_json(path: Path, payload: Mapping[str, object]) -> None:
    """Write ``payload`` to ``path`` whole (a temp file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=1, allow_nan=True) + "\n")
    os.replace(tmp, path)
