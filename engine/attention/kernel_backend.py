"""The shape both GPU kernel backends share: their kernels write the KV cache and
compute the decode rows (split-K, partition size from partition.py); prefill groups
go through TorchAttention.prefill (varlen flash in half precision, else masked SDPA). A subclass names
its kernel module, which provides ``write_kv_cache`` and ``paged_decode_attention``
with the same signatures (csrc/ops.py, triton_kernels.py)."""

from typing import Protocol

import torch

from .base import AttentionMetadata
from .partition import decode_partition_size
from .torch_backend import TorchAttention


class DecodeKernels(Protocol):
    """What a kernel module provides (csrc/ops.py, triton_kernels.py)."""

    def write_kv_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None: ...

    def paged_decode_attention(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, *,
                               scale: float, partition_size: int) -> None: ...


class KernelAttention(TorchAttention):
    needs_decode_mask = False
    kernels: DecodeKernels  # the kernel module, set by each subclass

    def __init__(self, device: torch.device):
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    def write_cache(self, k, v, kv_cache, slot_mapping):
        self.kernels.write_kv_cache(k, v, kv_cache[0], kv_cache[1], slot_mapping)

    def decode(self, q, kv_cache, meta: AttentionMetadata, out):
        block_size, kv_heads = kv_cache.shape[2:4]
        size = decode_partition_size(q.shape[0], kv_heads, meta.decode_block_tables.shape[1] * block_size,
                                     block_size, self.num_sms)
        self.kernels.paged_decode_attention(out, q, kv_cache[0], kv_cache[1], meta.decode_block_tables,
                                            meta.decode_seq_lens, scale=q.shape[-1] ** -0.5,
                                            partition_size=size)
