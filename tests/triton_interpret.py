"""Running Triton kernels under the interpreter from a test: ``TRITON_INTERPRET=1`` must be
set before triton decorates the kernels and must not leak into other tests, so the cases
run in one child process."""

import os
import subprocess
import sys
from pathlib import Path

import torch


def run_interpreted(child: str, cases: dict, folder: Path, timeout_s: float = 300) -> dict:
    """name -> (case, the child's output): ``child`` is Python source run as ``python -c child
    INPUTS OUTPUTS`` under TRITON_INTERPRET=1; it loads the cases from INPUTS (torch.save of
    ``cases``) and saves {name: output} to OUTPUTS. The child imports the splitserve this
    process imported (an installed copy or a checkout)."""
    inputs, outputs = folder / "inputs.pt", folder / "outputs.pt"
    torch.save(cases, inputs)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, sys.path)))
    proc = subprocess.run([sys.executable, "-c", child, str(inputs), str(outputs)], env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    got = torch.load(outputs)
    return {name: (cases[name], got[name]) for name in cases}
