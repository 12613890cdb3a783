"""The Triton kernel backend: triton_kernels.py for the KV cache write and the decode
rows (kernel_backend.py); prefill groups go through TorchAttention.prefill (varlen flash or SDPA).
Needs triton and a cache block size that is a power of two >= 16."""

from splitserve.engine.attention import triton_kernels
from splitserve.engine.attention.kernel_backend import KernelAttention


class TritonAttention(KernelAttention):
    name = "triton"
    kernels = triton_kernels
