"""The attention backend interface and the per-step metadata every backend reads.

A step's tokens are flattened into one batch of T tokens, decodes first:

    tokens:  [ d0 d1 ... d(D-1) | p0 chunk ......... | p1 chunk ..... ]
              one token each     q_start=D, q_len=n0  q_start=D+n0, ...
              (decode requests)  (prefill chunks, possibly after a cached prefix)

Prefill chunks are packed into groups, one attention call per group (prefill_batch.py):
on CUDA in half precision all chunks of a step go through one varlen flash call.

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
class PrefillGroup:
    """Prefill chunks that one attention call computes (built by prefill_batch.py).
    Chunks of a group are adjacent rows of the flat batch; see prefill_batch.py for
    the layout of ``key_slots`` and ``mask``."""

    q_start: int  # first row of the group's first chunk in the flat token batch
    q_len: int  # rows of all its chunks (Q)
    # [K] long: cache slot of every key of every chunk (each chunk's cached context, then
    # its new tokens); None: a single chunk without cached context, attending to its fresh K/V
    key_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [Q, K] bool block-diagonal causal mask; None: varlen kernel or is_causal
    cu_q: torch.Tensor | None  # [chunks + 1] int32 row offsets of the chunks (varlen only)
    cu_k: torch.Tensor | None  # [chunks + 1] int32 key offsets of the chunks (varlen only)
    max_q: int  # longest chunk in rows
    max_k: int  # longest chunk in keys


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    num_decodes: int  # rows [0, num_decodes) are decode tokens
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] long (padded with 0)
    decode_seq_lens: torch.Tensor  # [num_decodes] long: context length including the new token
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks*block_size] additive, or None if unpadded
    prefills: list[PrefillGroup]  # one attention call each


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
