"""Triton kernels: paged decode attention (split-K) and the KV cache write, with wrappers
that check their arguments (``splitserve.csrc.checks``, the same contracts as the CUDA
kernels) and launch. Imports triton: only ``triton_backend.py`` and tests import this.

Decode, one program per (sequence s, KV head, partition p); the GROUP query heads that
share the KV head are the rows of one ``tl.dot`` tile (padded to 16, its minimum):

    for each cache block b of the partition (tokens b*block_size ..):
        scores [G, block_size] = scale * q [G, hd] @ K_b^T      (tokens >= seq_len masked)
        online softmax: m = running max, l = running sum, acc = running P @ V

One partition: out = acc / l. Several: (acc / l, m, l) per partition, and a second kernel
merges a sequence's partitions: M = max m_p, w_p = l_p exp(m_p - M), out = sum w_p o_p / sum w_p.

The dots run in the cache dtype for fp16, and in fp32 for fp32 ("ieee") and bf16 ("tf32":
exact for bf16 inputs, whose 8-bit mantissas fit tf32's 11; it also keeps the probabilities
finer than a bf16 cast, and the interpreter cannot dot bf16 tiles).

The kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) for
the CPU tests; the variable must be set before this module is imported.
"""

import torch
import triton  # type: ignore[import-untyped]  # triton ships neither stubs nor py.typed
import triton.language as tl  # type: ignore[import-untyped]  # likewise

from ...csrc.checks import check_cache_write, check_decode, num_partitions

MIN_DOT = 16  # tl.dot's smallest tile side


@triton.jit
def _decode_partition(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                      block_tables_ptr, seq_lens_ptr, scale, num_heads, num_partitions, partition_size,
                      stride_out_s, stride_out_h, stride_q_s, stride_q_h, stride_c_block, stride_c_tok,
                      stride_c_head, stride_bt,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
                      DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    s = tl.program_id(0)
    kv_head = tl.program_id(1)
    p = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s).to(tl.int32)
    start = p * partition_size
    end = tl.minimum(start + partition_size, seq_len)  # < start: a partition past this sequence's end

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    t = tl.arange(0, BLOCK_SIZE)
    head = kv_head * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + s * stride_q_s + head[:, None] * stride_q_h + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [G, hd]
    if DOT_FP32:
        q = q.to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for b in range(start // BLOCK_SIZE, tl.cdiv(end, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + s * stride_bt + b)
        t_ok = b * BLOCK_SIZE + t < end
        offs = block_id * stride_c_block + t[:, None] * stride_c_tok + kv_head * stride_c_head + d[None, :]
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)  # [block_size, hd]
        if DOT_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [G, block_size]
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(e, 1)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)  # [block_size, hd]
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(e.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    rows_ok = g_ok & (start < seq_len)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]  # l == 0 only in a partition past the end (not stored)
    if SPLIT:
        idx = (s * num_heads + head) * num_partitions + p  # [G]
        tl.store(part_max_ptr + idx, m, mask=rows_ok)
        tl.store(part_sum_ptr + idx, l, mask=rows_ok)
        tl.store(part_out_ptr + idx[:, None] * HEAD_DIM + d[None, :], o, mask=rows_ok[:, None] & d_ok[None, :])
    else:
        tl.store(out_ptr + s * stride_out_s + head[:, None] * stride_out_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_reduce(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr, num_heads, num_partitions,
                   partition_size, stride_out_s, stride_out_h,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CHUNK: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + s).to(tl.int32)
    n = tl.cdiv(seq_len, partition_size)  # this sequence's partitions
    base = (s * num_heads + h) * num_partitions
    i = tl.arange(0, CHUNK)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM

    big_m = tl.full([CHUNK], float("-inf"), tl.float32)
    for c in range(0, n, CHUNK):
        big_m = tl.maximum(big_m, tl.load(part_max_ptr + base + c + i, mask=c + i < n, other=float("-inf")))
    big_m_s = tl.max(big_m, 0)
    total = tl.zeros([CHUNK], tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for c in range(0, n, CHUNK):
        ok = c + i < n
        w = tl.load(part_sum_ptr + base + c + i, mask=ok, other=0.0) * \
            tl.exp(tl.load(part_max_ptr + base + c + i, mask=ok, other=float("-inf")) - big_m_s)
        w = tl.where(ok, w, 0.0)
        po = tl.load(part_out_ptr + (base + c + i)[:, None] * HEAD_DIM + d[None, :],
                     mask=ok[:, None] & d_ok[None, :], other=0.0)  # [CHUNK, hd]
        acc += tl.sum(w[:, None] * po, 0)
        total += w
    o = acc / tl.sum(total, 0)
    tl.store(out_ptr + s * stride_out_s + h * stride_out_h + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _write_kv_cache(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, block_size,
                    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_c_block, stride_c_tok, stride_c_head,
                    KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    h = tl.arange(0, KV_HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = (h < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :] & (slot >= 0)  # slot -1: a padding token
    dst = (slot // block_size) * stride_c_block + (slot % block_size) * stride_c_tok + \
        h[:, None] * stride_c_head + d[None, :]
    k = tl.load(k_ptr + t * stride_k_t + h[:, None] * stride_k_h + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_v_t + h[:, None] * stride_v_h + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def check_block_size(block_size: int) -> None:
    """tl.dot tiles a cache block: its size must be a power of two >= 16."""
    if block_size < MIN_DOT or block_size & (block_size - 1):
        raise ValueError(f"block_size: the Triton kernels need a power of two >= {MIN_DOT}, got {block_size}")


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                           partition_size: int) -> None:
    """Same contract as ``splitserve.csrc.ops.paged_decode_attention``."""
    check_decode(out, q, k_cache, v_cache, block_tables, seq_lens, partition_size)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    check_block_size(block_size)
    if num_seqs == 0:
        return
    group = num_heads // kv_heads
    parts = num_partitions(block_tables, block_size, partition_size)
    split = parts > 1
    part_out = part_max = part_sum = out  # placeholders, never touched without a split
    if split:
        part_out = torch.empty((num_seqs, num_heads, parts, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_seqs, num_heads, parts), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    head_dim_pad = max(MIN_DOT, triton.next_power_of_2(head_dim))
    _decode_partition[(num_seqs, kv_heads, parts)](
        out, part_out, part_max, part_sum, q, k_cache, v_cache, block_tables, seq_lens, float(scale), num_heads,
        parts, partition_size, out.stride(0), out.stride(1), q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, SPLIT=split,
        DOT_FP32=q.dtype != torch.float16, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4)
    if split:
        _decode_reduce[(num_seqs, num_heads)](
            out, part_out, part_max, part_sum, seq_lens, num_heads, parts, partition_size, out.stride(0),
            out.stride(1), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            CHUNK=min(64, triton.next_power_of_2(parts)), num_warps=4)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Same contract as ``splitserve.csrc.ops.write_kv_cache`` (slot -1 skips a token)."""
    check_cache_write(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    _, block_size, kv_heads, head_dim = k_cache.shape
    _write_kv_cache[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, block_size, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        KV_HEADS=kv_heads, KV_HEADS_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), num_warps=1)
