"""Triton decode kernel for Multi-head Latent Attention (MLA, engine/models/mla.py) over the
paged latent KV cache: the absorbed decode's attention, read straight from the cache's
blocks through the block tables. Imports triton: only ``mla.py`` (CUDA tensors, or the
Triton interpreter) and tests import this.

Contract (``mla_decode``), for each decode row s and head h, with L = kv_lora + rope::

    o_lat[s, h] = sum_j softmax_j(scale * q_abs[s, h] . latent_j) * latent_j[:kv_lora]

    q_abs         [D, H, L]   the absorbed query [W_UK^T q_nope | rotated q_rope], last dim contiguous
    k/v_cache     [num_blocks, block_size, 1, L / 2]  one layer's K and V halves (kv_cache[0], kv_cache[1])
    block_tables  [D, max_blocks] int64, seq_lens [D] int64 (context incl. the new token, >= 1)
    out           [D, H, kv_lora] in q_abs's dtype

Layout (mla_config.py): token j of row s sits in block ``block_tables[s, j // block_size]``
at offset ``j % block_size``; its latent's values [0, L/2) are that slot of the K half, the
values [L/2, L) the same slot of the V half. The kernel splits the latent by meaning, not by
half: the compressed part c = latent[:kv_lora] (padded to a power of two >= 16) and the
rope key latent[kv_lora:] (likewise), each value read from whichever half holds it:

    scores [BLOCK_H, BLOCK_N] = scale * (q_c @ c^T + q_rope @ rope^T)   (tokens >= seq_len masked)
    online softmax over the tiles: m = running max, l = running sum, acc = running P @ c

One program per (row s, BLOCK_H heads, partition p of the context); a tile is BLOCK_N
consecutive tokens, each through its own block-table entry, so any block size works (4, 16,
not only powers of two). One partition: out = acc / l. Several (split-K, flash-decoding):
(acc / l, m, l) per partition in fp32 scratch, merged by triton_kernels' reduce kernel.

Precision: every dot and the softmax accumulate in fp32. Dots run in fp32 with "ieee" for
fp32 inputs, in fp32 with "tf32" for bf16 (exact for bf16 operands; the probabilities are
rounded to tf32, and the interpreter cannot dot bf16 tiles), natively for fp16 (the
probabilities rounded to fp16), as triton_kernels.py does. Tolerance against the torch
reference (``MLAttention.absorbed`` on the gathered latents, fp32): 1e-5 for fp32 inputs;
1.6e-2 (atol = rtol) for bf16 and 2e-3 for fp16 inputs, whose output is rounded to the input
dtype (tests/test_mla_decode_kernel.py).

Runs under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) for the CPU tests;
the variable must be set before this module is imported.
"""

from typing import NoReturn

import torch
import triton  # type: ignore[import-untyped]  # triton ships neither stubs nor py.typed
import triton.language as tl  # type: ignore[import-untyped]  # likewise

from ...csrc.checks import check_caches, check_int64, check_rows
from .partition import BLOCKS_PER_SM, MIN_PARTITION_SIZE
from .triton_kernels import MIN_DOT, _decode_reduce

BLOCK_H = 16  # heads per program: the rows of one tl.dot tile (its smallest side)
BLOCK_N = 16  # tokens per tile
MAX_PARTITION_SIZE = 512  # tokens per split-K partition, at most
MAX_CHUNK = 16  # partitions the reduce kernel merges at a time (its tile is [CHUNK, kv_lora])


@triton.jit
def _mla_decode_partition(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                          block_tables_ptr, seq_lens_ptr, scale, num_heads, num_partitions, partition_size,
                          stride_out_s, stride_out_h, stride_q_s, stride_q_h, stride_c_block, stride_c_tok,
                          stride_bt,
                          HALF: tl.constexpr, KV_LORA: tl.constexpr, KV_LORA_PAD: tl.constexpr,
                          LATENT: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
                          DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    s = tl.program_id(0)
    hb = tl.program_id(1)
    p = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s).to(tl.int32)
    start = p * partition_size
    end = tl.minimum(start + partition_size, seq_len)  # < start: a partition past this row's end

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    c = tl.arange(0, KV_LORA_PAD)  # latent index of the compressed part
    c_ok = c < KV_LORA
    r = KV_LORA + tl.arange(0, ROPE_PAD)  # latent index of the rope key
    r_ok = r < LATENT
    n = tl.arange(0, BLOCK_N)
    q_row = q_ptr + s * stride_q_s + h[:, None] * stride_q_h
    q_c = tl.load(q_row + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)  # [BLOCK_H, KV_LORA_PAD]
    q_r = tl.load(q_row + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_H, ROPE_PAD]
    if DOT_FP32:
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)
    # each latent index in its half: [0, HALF) in the K half, [HALF, LATENT) in the V half
    c_in_k = c < HALF
    c_col = tl.where(c_in_k, c, c - HALF)
    r_in_k = r < HALF
    r_col = tl.where(r_in_k, r, r - HALF)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, KV_LORA_PAD], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        pos = t0 + n
        t_ok = pos < end
        block_id = tl.load(block_tables_ptr + s * stride_bt + pos // BLOCK_SIZE, mask=t_ok, other=0)
        slot = block_id * stride_c_block + (pos % BLOCK_SIZE) * stride_c_tok  # [BLOCK_N] element offsets
        c_ptrs = tl.where(c_in_k[None, :], k_cache_ptr, v_cache_ptr) + slot[:, None] + c_col[None, :]
        r_ptrs = tl.where(r_in_k[None, :], k_cache_ptr, v_cache_ptr) + slot[:, None] + r_col[None, :]
        lat_c = tl.load(c_ptrs, mask=t_ok[:, None] & c_ok[None, :], other=0.0)  # [BLOCK_N, KV_LORA_PAD]
        lat_r = tl.load(r_ptrs, mask=t_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_N, ROPE_PAD]
        if DOT_FP32:
            lat_c = lat_c.to(tl.float32)
            lat_r = lat_r.to(tl.float32)
        scores = tl.dot(q_c, tl.trans(lat_c), input_precision=DOT_PRECISION)
        scores = tl.dot(q_r, tl.trans(lat_r), scores, input_precision=DOT_PRECISION) * scale  # [BLOCK_H, BLOCK_N]
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(e, 1)
        acc = acc * alpha[:, None] + tl.dot(e.to(lat_c.dtype), lat_c, input_precision=DOT_PRECISION)
        m = m_new

    rows_ok = h_ok & (start < seq_len)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]  # l == 0 only in a partition past the end (not stored)
    if SPLIT:
        idx = (s * num_heads + h) * num_partitions + p  # [BLOCK_H]
        tl.store(part_max_ptr + idx, m, mask=rows_ok)
        tl.store(part_sum_ptr + idx, l, mask=rows_ok)
        tl.store(part_out_ptr + idx[:, None] * KV_LORA + c[None, :], o, mask=rows_ok[:, None] & c_ok[None, :])
    else:
        tl.store(out_ptr + s * stride_out_s + h[:, None] * stride_out_h + c[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & c_ok[None, :])


def _bad(name: str, what: str) -> NoReturn:
    raise ValueError(f"{name}: {what}")


def mla_partition_size(num_rows: int, num_heads: int, max_len: int, num_sms: int) -> int:
    """Tokens per split-K partition (a multiple of BLOCK_N): partition.py's rule over
    (row, BLOCK_H heads) programs: start at MAX_PARTITION_SIZE and halve while the launch
    would have fewer than BLOCKS_PER_SM programs per SM, down to MIN_PARTITION_SIZE.
    ``max_len``: the widest block table in tokens (no device read)."""
    programs = num_rows * -(-num_heads // BLOCK_H)
    size = MAX_PARTITION_SIZE
    while size // 2 >= MIN_PARTITION_SIZE and programs * -(-max_len // size) < BLOCKS_PER_SM * num_sms:
        size //= 2
    return size


def mla_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, *, kv_lora_rank: int, scale: float, partition_size: int | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """o_lat [D, H, kv_lora_rank] in q's dtype (the module docstring's contract), written into
    ``out`` when given. ``partition_size``: tokens per split-K partition, a multiple of
    BLOCK_N up to MAX_PARTITION_SIZE; None picks one for the device (mla_partition_size).
    No host read of a device tensor: the launch's size comes from the tensors' shapes."""
    check_caches(k_cache, v_cache, None)
    check_rows("q", q, k_cache)
    num_rows, num_heads, latent = q.shape
    _, block_size, kv_heads, half = k_cache.shape
    if kv_heads != 1:
        _bad("k_cache", f"the latent cache has one KV head, got {kv_heads}")
    if latent != 2 * half:
        _bad("q", f"latent width {latent} is not twice the cache's half {half}")
    if not 0 < kv_lora_rank < latent:
        _bad("kv_lora_rank", f"must be in 1..{latent - 1} (the rope key takes the rest), got {kv_lora_rank}")
    if out is None:
        out = torch.empty((num_rows, num_heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    check_rows("out", out, k_cache)
    if tuple(out.shape) != (num_rows, num_heads, kv_lora_rank):
        _bad("out", f"must be [{num_rows}, {num_heads}, {kv_lora_rank}], got {tuple(out.shape)}")
    if block_tables.dim() != 2:
        _bad("block_tables", f"must be [num_rows, max_blocks], got shape {tuple(block_tables.shape)}")
    check_int64("block_tables", block_tables, (num_rows, block_tables.shape[1]), k_cache.device)
    check_int64("seq_lens", seq_lens, (num_rows,), k_cache.device)
    max_len = block_tables.shape[1] * block_size
    if partition_size is None:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        partition_size = mla_partition_size(num_rows, num_heads, max_len, num_sms)
    if not (0 < partition_size <= MAX_PARTITION_SIZE and partition_size % BLOCK_N == 0):
        _bad("partition_size", f"must be a multiple of {BLOCK_N} in 1..{MAX_PARTITION_SIZE}, got {partition_size}")
    if num_rows == 0:
        return out
    parts = max(1, -(-max_len // partition_size))
    split = parts > 1
    part_out = part_max = part_sum = out  # placeholders, never touched without a split
    if split:
        part_out = torch.empty((num_rows, num_heads, parts, kv_lora_rank), dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_rows, num_heads, parts), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    kv_lora_pad = max(MIN_DOT, triton.next_power_of_2(kv_lora_rank))
    _mla_decode_partition[(num_rows, triton.cdiv(num_heads, BLOCK_H), parts)](
        out, part_out, part_max, part_sum, q, k_cache, v_cache, block_tables, seq_lens, float(scale), num_heads,
        parts, partition_size, out.stride(0), out.stride(1), q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), block_tables.stride(0),
        HALF=half, KV_LORA=kv_lora_rank, KV_LORA_PAD=kv_lora_pad, LATENT=latent,
        ROPE_PAD=max(MIN_DOT, triton.next_power_of_2(latent - kv_lora_rank)), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        BLOCK_SIZE=block_size, SPLIT=split, DOT_FP32=q.dtype != torch.float16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4 if kv_lora_pad <= 128 else 8)
    if split:
        _decode_reduce[(num_rows, num_heads)](
            out, part_out, part_max, part_sum, seq_lens, num_heads, parts, partition_size, out.stride(0),
            out.stride(1), HEAD_DIM=kv_lora_rank, HEAD_DIM_PAD=kv_lora_pad,
            CHUNK=min(MAX_CHUNK, triton.next_power_of_2(parts)), num_warps=4)
    return out
