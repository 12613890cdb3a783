"""The Triton kernel backend: triton_kernels.py for the KV cache write and the decode
rows; prefill chunks go through the torch reference's SDPA (TorchAttention.prefill).
Needs triton and a cache block size that is a power of two >= 16."""

import torch

from splitserve.engine.attention import triton_kernels
from splitserve.engine.attention.base import AttentionMetadata
from splitserve.engine.attention.partition import decode_partition_size
from splitserve.engine.attention.torch_backend import TorchAttention


class TritonAttention(TorchAttention):
    name = "triton"
    needs_decode_mask = False

    def __init__(self, device: torch.device):
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    def write_cache(self, k, v, kv_cache, slot_mapping):
        triton_kernels.write_kv_cache(k, v, kv_cache[0], kv_cache[1], slot_mapping)

    def decode(self, q, kv_cache, meta: AttentionMetadata, out):
        block_size, kv_heads = kv_cache.shape[2:4]
        size = decode_partition_size(q.shape[0], kv_heads, meta.decode_block_tables.shape[1] * block_size,
                                     block_size, self.num_sms)
        triton_kernels.paged_decode_attention(out, q, kv_cache[0], kv_cache[1], meta.decode_block_tables,
                                              meta.decode_seq_lens, scale=q.shape[-1] ** -0.5,
                                              partition_size=size)
