"""Picks an engine's attention backend from ``config.attention_backend`` and the device.

    device not cuda:  "auto" | "torch" -> torch reference;  "cuda" | "triton" -> ValueError
    device cuda:      "auto" -> the first that works here, each fallback logged:
                                CUDA kernels (they build, head_dim 64 or 128, block_size <= 512)
                                Triton kernels (triton imports, block_size a power of two >= 16)
                                torch reference
                      "cuda" | "triton" | "torch" -> that one, or an error saying why not

Must not: change the model's numerics on CPU (the torch reference there, always).
"""

import logging

import torch

from ...common.config import EngineConfig
from .base import AttentionBackend
from .torch_backend import TorchAttention

log = logging.getLogger(__name__)


def select_backend(config: EngineConfig, device: torch.device, head_dim: int) -> AttentionBackend:
    name = config.attention_backend
    if device.type != "cuda":
        if name in ("cuda", "triton"):
            raise ValueError(f"attention_backend: {name!r} needs a CUDA device, the engine runs on {device}; "
                             "use auto or torch")
        return TorchAttention()
    if name == "torch":
        return TorchAttention()
    if name == "cuda":
        return _cuda(device, head_dim, config.block_size)
    if name == "triton":
        return _triton(device, config.block_size)
    for make in (lambda: _cuda(device, head_dim, config.block_size), lambda: _triton(device, config.block_size)):
        try:
            return make()
        except (ValueError, RuntimeError) as e:  # CsrcBuildError is a RuntimeError
            log.warning("attention backend fallback: %s", e)
    return TorchAttention()


def _cuda(device: torch.device, head_dim: int, block_size: int) -> AttentionBackend:
    from ...csrc.checks import MAX_PARTITION_SIZE
    from .cuda_backend import SUPPORTED_HEAD_DIMS, CudaAttention

    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"attention_backend: the CUDA kernels support head_dim {SUPPORTED_HEAD_DIMS}, the model "
                         f"has {head_dim}; use triton or torch")
    if block_size > MAX_PARTITION_SIZE:  # a split-K partition holds whole blocks
        raise ValueError(f"attention_backend: the CUDA kernels need block_size <= {MAX_PARTITION_SIZE}, "
                         f"got {block_size}")
    return CudaAttention(device)


def _triton(device: torch.device, block_size: int) -> AttentionBackend:
    if not torch.cuda.is_available():
        raise ValueError(f"attention_backend: the Triton kernels need a visible CUDA GPU, torch {torch.__version__} "
                         "sees none; use torch")
    try:
        from .triton_backend import TritonAttention
        from .triton_kernels import check_block_size
    except ImportError as e:
        raise ValueError(f"attention_backend: the Triton kernels need triton ({e}); install it "
                         "(deploy/requirements.txt pins it) or use cuda or torch") from e
    try:
        check_block_size(block_size)
    except ValueError as e:
        raise ValueError(f"attention_backend: triton cannot run this engine: {e}") from e
    return TritonAttention(device)
