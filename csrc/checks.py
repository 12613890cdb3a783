"""Argument checks shared by the kernel wrappers: the CUDA ones (``csrc/ops.py``) and the
Triton ones (``engine/attention/triton_kernels.py``) take the same tensors.

Every check raises ``ValueError`` naming the argument; none touches GPU memory or
synchronizes. Shapes, as the kernels read them:

    q, out         [num_seqs, num_heads, head_dim]       any row strides, last dim contiguous
    k, v           [num_tokens, num_kv_heads, head_dim]  any row strides, last dim contiguous
    k/v_cache      [num_blocks, block_size, num_kv_heads, head_dim]  one layer; K and V alike
    block_tables   [num_seqs, max_blocks] int64, rows contiguous
    seq_lens       [num_seqs] int64, each in 1 .. max_blocks * block_size
    slot_mapping   [num_tokens] int64, block * block_size + offset, or -1 to skip the token
"""

from typing import NoReturn

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_PARTITION_SIZE = 512  # tokens per split-K partition (csrc/kernels.h kMaxPartitionSize)


def _fail(name: str, what: str) -> NoReturn:
    raise ValueError(f"{name}: {what}")


def check_rows(name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """A 3-D ``[rows, heads, head_dim]`` tensor of a kernel dtype with a contiguous last dim."""
    if t.dim() != 3:
        _fail(name, f"must be [rows, heads, head_dim], got shape {tuple(t.shape)}")
    if t.dtype not in KERNEL_DTYPES:
        _fail(name, f"dtype must be float32, float16 or bfloat16, got {t.dtype}")
    if t.stride(2) != 1:
        _fail(name, f"last dim must be contiguous, got strides {t.stride()}")
    if like is not None and (t.dtype != like.dtype or t.device != like.device):
        _fail(name, f"must be {like.dtype} on {like.device} like the cache, got {t.dtype} on {t.device}")


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dims: tuple[int, ...] | None) -> None:
    """One layer's K and V caches ``[num_blocks, block_size, kv_heads, head_dim]``, alike."""
    if k_cache.dim() != 4:
        _fail("k_cache", f"must be [num_blocks, block_size, kv_heads, head_dim], got shape {tuple(k_cache.shape)}")
    if k_cache.dtype not in KERNEL_DTYPES:
        _fail("k_cache", f"dtype must be float32, float16 or bfloat16, got {k_cache.dtype}")
    if k_cache.stride(3) != 1:
        _fail("k_cache", f"last dim must be contiguous, got strides {k_cache.stride()}")
    if (v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device) != \
            (k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device):
        _fail("v_cache", "must have the shape, strides, dtype and device of k_cache")
    if head_dims is not None and k_cache.shape[3] not in head_dims:
        _fail("k_cache", f"head_dim {k_cache.shape[3]} is not supported by this kernel (supported: {head_dims})")


def check_int64(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype != torch.int64 or tuple(t.shape) != shape or t.device != device:
        _fail(name, f"must be int64 {list(shape)} on {device}, got {t.dtype} {list(t.shape)} on {t.device}")
    if t.stride(-1) != 1:
        _fail(name, f"rows must be contiguous, got strides {t.stride()}")


def check_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, partition_size: int,
                 head_dims: tuple[int, ...] | None = None) -> None:
    """The arguments of paged decode attention (CUDA and Triton alike)."""
    check_caches(k_cache, v_cache, head_dims)
    check_rows("q", q, k_cache)
    check_rows("out", out, k_cache)
    num_seqs, num_heads, head_dim = q.shape
    if out.shape != q.shape:
        _fail("out", f"must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if head_dim != k_cache.shape[3]:
        _fail("q", f"head_dim {head_dim} differs from the cache's {k_cache.shape[3]}")
    if num_heads % k_cache.shape[2]:
        _fail("q", f"{num_heads} heads are not a multiple of the cache's {k_cache.shape[2]} KV heads")
    if block_tables.dim() != 2:
        _fail("block_tables", f"must be [num_seqs, max_blocks], got shape {tuple(block_tables.shape)}")
    check_int64("block_tables", block_tables, (num_seqs, block_tables.shape[1]), k_cache.device)
    check_int64("seq_lens", seq_lens, (num_seqs,), k_cache.device)
    block_size = k_cache.shape[1]
    if not (0 < partition_size <= MAX_PARTITION_SIZE and partition_size % block_size == 0):
        _fail("partition_size", f"must be a multiple of block_size {block_size} in 1..{MAX_PARTITION_SIZE}, "
                                f"got {partition_size}")


def check_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """The arguments of the KV cache write (CUDA and Triton alike)."""
    check_caches(k_cache, v_cache, None)
    check_rows("k", k, k_cache)
    check_rows("v", v, k_cache)
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        _fail("k", f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [num_tokens, {k_cache.shape[2]}, "
                   f"{k_cache.shape[3]}] like the cache")
    check_int64("slot_mapping", slot_mapping, (k.shape[0],), k_cache.device)


def num_partitions(block_tables: torch.Tensor, block_size: int, partition_size: int) -> int:
    """Partitions that cover the widest block table (no device sync: the table's width
    bounds every sequence's length)."""
    return max(1, -(-block_tables.shape[1] * block_size // partition_size))
