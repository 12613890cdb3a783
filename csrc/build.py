"""Builds the CUDA kernels on first use and loads them as ``torch.ops.splitserve.*``.

The sources (``*.cu``, ``bindings.cpp``) are compiled with torch's extension builder
for the GPUs of this machine into ``<cache_root>/torch_extensions/<torch and CUDA
version>``; later processes reuse the library unless a source changed. Nothing here
runs on import: a CPU-only machine never builds or needs this.

``load_ops()`` raises ``CsrcBuildError`` (saying what to do) when the kernels cannot
be built: no CUDA torch or GPU, no CUDA toolkit, no ninja, or a compiler error.
"""

import functools
import logging
import shutil
from pathlib import Path

import torch

from ..common.bundled import cache_root

log = logging.getLogger(__name__)

SOURCES = ("paged_attention.cu", "cache_ops.cu", "bindings.cpp")
EXTENSION = "splitserve_C"
_FALLBACK = "or choose another attention backend: --attention-backend triton (needs triton) or torch"


class CsrcBuildError(RuntimeError):
    """The CUDA kernels cannot be built or loaded here; the message says what to do."""


def build_dir() -> Path:
    return cache_root() / "torch_extensions" / f"{EXTENSION}-torch{torch.__version__}-cuda{torch.version.cuda}"


@functools.cache
def load_ops() -> None:
    """Builds (first call of a machine) and loads the extension; afterwards
    ``torch.ops.splitserve.<op>`` exists. Safe to call repeatedly."""
    if torch.version.cuda is None:
        raise CsrcBuildError(f"the CUDA kernels need a CUDA build of torch, this one is {torch.__version__}; "
                             f"install one, {_FALLBACK}")
    if not torch.cuda.is_available():
        raise CsrcBuildError(f"the CUDA kernels need a visible GPU and none is (CUDA_VISIBLE_DEVICES?); {_FALLBACK}")
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise CsrcBuildError(f"building the CUDA kernels needs the CUDA toolkit {torch.version.cuda} (nvcc); "
                             f"install it and set CUDA_HOME, {_FALLBACK}")
    if not cpp_extension.is_ninja_available():
        raise CsrcBuildError(f"building the CUDA kernels needs ninja: pip install ninja, {_FALLBACK}")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise CsrcBuildError(f"building the CUDA kernels needs a C++ compiler (g++); install one, {_FALLBACK}")
    here = Path(__file__).parent
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    log.info("loading splitserve CUDA kernels from %s (building them the first time, about a minute)", out)
    try:
        cpp_extension.load(name=EXTENSION, sources=[str(here / s) for s in SOURCES], build_directory=str(out),
                           extra_cflags=["-O3"], extra_cuda_cflags=["-O3"], is_python_module=False)
    except Exception as e:  # the builder raises RuntimeError, OSError or CalledProcessError
        raise CsrcBuildError(f"building the CUDA kernels in {out} failed ({e}); fix the toolchain and delete that "
                             f"folder to rebuild, {_FALLBACK}") from e
