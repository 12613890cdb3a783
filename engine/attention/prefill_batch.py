"""Packs a step's prefill chunks into groups, one attention call per group, so that
prefill is not one call per chunk per layer. Built once per step by the model runner;
every layer reuses it.

A chunk has q rows of new tokens after ctx tokens already in the cache. Its keys are
its ctx + q tokens, read back from the cache (the new tokens are written before
attention runs). A group concatenates its chunks:

    queries  [ a: q_a rows | b: q_b rows | ... ]          cu_q = [0, q_a, q_a + q_b, ...]
    keys     [ a: ctx_a + q_a | b: ctx_b + q_b | ... ]    cu_k = [0, k_a, k_a + k_b, ...]
    key_slots[c] = cache slot of key c (block_table[pos // bs] * bs + pos % bs)

    mask [Q, K]: row r of chunk i sees key c   <=>  c in chunk i's keys and
                 c - cu_k[i] <= ctx_i + (r - cu_q[i])     (query j sits at position ctx_i + j)

       keys:  a a a a a | b b b
    rows a0   x x x . . | . . .      ctx_a = 2, q_a = 3
         a1   x x x x . | . . .
         a2   x x x x x | . . .
         b0   . . . . . | x . .      ctx_b = 0, q_b = 3
         b1   . . . . . | x x .
         b2   . . . . . | x x x

Two ways to run a group:
  varlen  (CUDA, fp16/bf16, torch's flash varlen): every chunk of the step in ONE group,
          no mask (cu_q/cu_k and bottom-right causal do its work), no wasted compute.
  masked  (CPU and otherwise): SDPA with the mask above. Masked-out keys still cost
          compute, so chunks join a group only while its dense area Q * K stays within
          MAX_DENSE_RATIO of the useful sum(q_i * k_i); a lone chunk without cached
          context needs no mask at all (is_causal over its fresh K/V).

Must not: touch the cache or the model; it only describes the calls.
"""

import logging
from typing import NamedTuple

import torch

from .base import PrefillGroup

log = logging.getLogger(__name__)

MAX_DENSE_RATIO = 2.0  # a masked group may compute at most twice the attention it needs


class ChunkSpec(NamedTuple):
    q_start: int  # first row in the flat batch
    q_len: int  # new tokens
    ctx_len: int  # tokens already cached before this chunk
    key_slots: torch.Tensor  # [ctx_len + q_len] long, CPU: cache slot of each of its tokens


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's flash varlen attention runs here: CUDA, half precision, and a tiny
    probe call succeeds (it needs an Ampere or newer GPU)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn

        q = torch.zeros(2, 2, 64, dtype=dtype, device=device)  # [T, heads, hd]: 2 sequences of 1 token
        kv = torch.zeros(2, 1, 64, dtype=dtype, device=device)  # [T, kv_heads, hd]
        cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
        varlen_attn(q, kv, kv, cu, cu, 1, 1, window_size=(-1, 0), enable_gqa=True)
        return True
    except (ImportError, RuntimeError, TypeError) as e:
        log.warning("varlen flash attention unavailable on %s (%s): prefill uses masked SDPA groups", device, e)
        return False


def build_prefill_groups(chunks: list[ChunkSpec], device: torch.device, varlen: bool) -> list[PrefillGroup]:
    """Groups of adjacent chunks (``chunks`` in row order), tensors on ``device``."""
    if not chunks:
        return []
    if varlen:
        return [_group(chunks, device, with_mask=False)]
    groups, current = [], [chunks[0]]
    for c in chunks[1:]:
        if _dense_ratio(current + [c]) <= MAX_DENSE_RATIO:  # read per call: tests vary it
            current.append(c)
        else:
            groups.append(current)
            current = [c]
    groups.append(current)
    return [_group(g, device, with_mask=True) for g in groups]


def _dense_ratio(chunks: list[ChunkSpec]) -> float:
    q = sum(c.q_len for c in chunks)
    k = sum(c.ctx_len + c.q_len for c in chunks)
    return q * k / sum(c.q_len * (c.ctx_len + c.q_len) for c in chunks)


def _group(chunks: list[ChunkSpec], device: torch.device, with_mask: bool) -> PrefillGroup:
    q_lens = torch.tensor([c.q_len for c in chunks])  # [n]
    k_lens = torch.tensor([c.ctx_len + c.q_len for c in chunks])  # [n]
    q_total, k_total = int(q_lens.sum()), int(k_lens.sum())
    max_q, max_k = int(q_lens.max()), int(k_lens.max())
    if with_mask and len(chunks) == 1 and chunks[0].ctx_len == 0:
        return PrefillGroup(chunks[0].q_start, q_total, None, None, None, None, max_q, max_k)
    key_slots = torch.cat([c.key_slots for c in chunks]).to(device)  # [K]
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])  # [n + 1]
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), k_lens.cumsum(0)])  # [n + 1]
    if not with_mask:
        return PrefillGroup(chunks[0].q_start, q_total, key_slots, None, cu_q.to(device, torch.int32),
                            cu_k.to(device, torch.int32), max_q, max_k)
    ids = torch.arange(len(chunks))
    q_chunk = ids.repeat_interleave(q_lens)  # [Q] chunk of each row
    k_chunk = ids.repeat_interleave(k_lens)  # [K] chunk of each key
    ctx = k_lens - q_lens  # [n]
    # last key column (in group coordinates) each row may see
    limit = cu_k[q_chunk] + ctx[q_chunk] + torch.arange(q_total) - cu_q[q_chunk]  # [Q]
    mask = (q_chunk[:, None] == k_chunk[None, :]) & (torch.arange(k_total)[None, :] <= limit[:, None])  # [Q, K]
    return PrefillGroup(chunks[0].q_start, q_total, key_slots, mask.to(device), None, None, max_q, max_k)
