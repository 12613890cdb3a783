"""The attention backend interface and the per-step metadata every backend reads.

A step's tokens are flattened into one batch of T tokens, decodes first:

    tokens:  [ d0 d1 ... d(D-1) | p0 chunk ......... | p1 chunk ..... ]
              one token each     q_start=D, q_len=n0  q_start=D+n0, ...
              (decode requests)  (prefill chunks, possibly after a cached prefix)

Every token's K/V is written into the paged cache at ``slot_mapping[t]``
(= block_id * block_size + offset) before attention reads it back through block
tables, so a request's KV is never held in a per-request contiguous tensor.

KV cache of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = K, 1 = V).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillChunk:
    q_start: int  # first row of this chunk in the flat token batch
    q_len: int  # new tokens computed this step
    ctx_len: int  # tokens already in the cache before this chunk (cached prefix + earlier chunks)
    block_table: torch.Tensor  # [num_blocks_of_request] long


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    num_decodes: int  # rows [0, num_decodes) are decode tokens
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] long (padded with 0)
    decode_seq_lens: torch.Tensor  # [num_decodes] long: context length including the new token
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks*block_size] additive, or None if unpadded
    prefills: list[PrefillChunk]


class AttentionBackend(ABC):
    """Computes causal attention for a flat batch over the paged KV cache."""

    name: str
    needs_decode_mask: bool  # reads meta.decode_mask (the kernels read decode_seq_lens instead)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (new tokens);
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], written in place.
        Returns [T, num_heads * head_dim]."""
