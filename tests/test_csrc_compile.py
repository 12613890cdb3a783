"""The CUDA sources compile, without a GPU: the kernels with nvcc for sm_80 and sm_90
(no register spills), the torch bindings with the host compiler against this torch's
headers. Skipped, saying why, where nvcc or g++ is missing. The GPU tests
(test_gpu_kernels.py) build and run them for real."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension

CSRC = Path(__file__).resolve().parent.parent / "csrc"
ARCHS = (80, 90)


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and cpp_extension.CUDA_HOME:
        candidate = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
        found = str(candidate) if candidate.exists() else None
    return found


def _cuda_includes(nvcc: str) -> list[str]:
    """The toolkit's include folders (cuda_runtime.h, cuda_fp16.h, ...) as nvcc itself passes them
    (/usr/local/bin/nvcc may be a wrapper script far from the toolkit)."""
    out = subprocess.run([nvcc, "-dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True).stderr
    for line in out.splitlines():
        if line.startswith("#$ INCLUDES="):
            return [flag[2:] for flag in line.split("=", 1)[1].replace('"', " ").split() if flag.startswith("-I")]
    return [str(Path(nvcc).resolve().parent.parent / "include")]


@pytest.fixture(scope="module")
def nvcc():
    path = _nvcc()
    if path is None:
        pytest.skip("nvcc not found (install the CUDA toolkit or set CUDA_HOME to compile-check csrc/)")
    return path


@pytest.mark.slow  # ~25 s of CPU per arch for the attention kernel's 30 instantiations
def test_kernels_compile_for_sm80_and_sm90(nvcc, tmp_path):
    """Every .cu file for both archs at once (parallel processes), with the flags torch's
    builder adds (-std=c++20, no implicit half/bf16 conversions)."""
    jobs = {}
    for src in sorted(CSRC.glob("*.cu")):
        for arch in ARCHS:
            cmd = [nvcc, "-std=c++20", "-O3", *cpp_extension.COMMON_NVCC_FLAGS, "-c",
                   f"-gencode=arch=compute_{arch},code=sm_{arch}",
                   "-Xptxas=-warn-spills", str(src), "-o", str(tmp_path / f"{src.stem}.sm{arch}.o")]
            jobs[f"{src.name} sm_{arch}"] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                             text=True)
    assert len(jobs) == 2 * len(ARCHS), f"expected paged_attention.cu and cache_ops.cu, got {sorted(jobs)}"
    for what, proc in jobs.items():
        out, _ = proc.communicate(timeout=540)
        assert proc.returncode == 0, f"{what} failed to compile:\n{out[-4000:]}"
        assert "spill" not in out, f"{what} spills registers:\n{out[-2000:]}"


def test_bindings_compile_against_torch_headers(nvcc, tmp_path):
    """Syntax and types of bindings.cpp (op schemas are checked when a GPU loads them).
    A CPU wheel of torch ships c10/cuda headers but not the one CMake generates for CUDA
    builds, which only defines the shared-library export macro: an empty one stands in."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) to compile-check csrc/bindings.cpp")
    includes = [*cpp_extension.include_paths(), *_cuda_includes(nvcc)]
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in includes):
        macros = tmp_path / "c10/cuda/impl/cuda_cmake_macros.h"
        macros.parent.mkdir(parents=True)
        macros.write_text("#pragma once\n")
        includes.insert(0, str(tmp_path))
    cmd = [cxx, "-std=c++20", "-Wall", "-Werror", "-fsyntax-only", *(f"-I{p}" for p in includes),
           str(CSRC / "bindings.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"bindings.cpp failed to compile:\n{proc.stderr[-4000:]}"
