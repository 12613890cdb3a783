"""The CUDA kernel backend: csrc/ kernels for the KV cache write and the decode rows
(kernel_backend.py); prefill groups go through TorchAttention.prefill (varlen flash or SDPA).

Constructing it builds the kernels on first use (``csrc.build.load_ops``), raising
``CsrcBuildError`` with what to do when they cannot be built.
"""

import torch

from ...csrc import ops
from ...csrc.build import load_ops
from .kernel_backend import KernelAttention

SUPPORTED_HEAD_DIMS = ops.CUDA_HEAD_DIMS


class CudaAttention(KernelAttention):
    name = "cuda"
    kernels = ops

    def __init__(self, device: torch.device):
        load_ops()
        super().__init__(device)
