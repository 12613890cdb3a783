"""The Triton kernel backend: triton_kernels.py for the KV cache write and the decode
rows (kernel_backend.py); prefill groups go through TorchAttention.prefill (varlen flash or SDPA).
Needs triton and a cache block size that is a power of two >= 16."""

from . import triton_kernels
from .kernel_backend import KernelAttention


class TritonAttention(KernelAttention):
    name = "triton"
    kernels = triton_kernels
