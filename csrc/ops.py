"""Python entry points of the CUDA kernels (``torch.ops.splitserve.*``).

Each wrapper checks dtypes, shapes and strides (``checks.py``, plus the 16-byte
alignment the vector loads need), allocates what the kernel writes, and launches on
the current stream. Callers run ``build.load_ops()`` once first; the CUDA attention
backend and the benchmarks do.

Block pack / unpack move whole blocks between the cache of every layer and one
contiguous buffer (the kvtransfer wire order, ``kvtransfer/layout.py``):

    kv_caches [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    packed    [len(block_ids), num_layers, 2, block_size, kv_heads, head_dim]
              packed[i] = kv_caches[:, :, block_ids[i]]
"""

from collections.abc import Sequence

import torch

from .checks import check_cache_write, check_decode, num_partitions

CUDA_HEAD_DIMS = (64, 128)  # head dims the attention kernel is instantiated for
MAX_GRID_YZ = 65535  # CUDA's limit on grid dims y and z (sequences, planes)
MAX_PARTITIONS = 8192  # the merge kernel keeps one float per partition in 48 KiB of shared memory


def _check_cuda_aligned(name: str, t: torch.Tensor, dims: range) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name}: must be a CUDA tensor, got one on {t.device}")
    vec = 16 // t.element_size()
    if t.data_ptr() % 16 or any(t.stride(d) % vec for d in dims):
        raise ValueError(f"{name}: needs 16-byte aligned rows (data_ptr % 16 == 0 and strides multiples of "
                         f"{vec}), got data_ptr {t.data_ptr():#x} strides {t.stride()}")


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                           partition_size: int) -> None:
    """out[s, h] = softmax(scale * q[s, h] . K_s^T) V_s over sequence s's first seq_lens[s]
    cached tokens, KV head h // (num_heads // kv_heads). Shapes: ``checks.py``; split-K
    over ``partition_size``-token partitions when the widest table holds more."""
    check_decode(out, q, k_cache, v_cache, block_tables, seq_lens, partition_size, CUDA_HEAD_DIMS)
    _check_cuda_aligned("k_cache", k_cache, range(3))
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs > MAX_GRID_YZ:
        raise ValueError(f"q: at most {MAX_GRID_YZ} sequences per call, got {num_seqs}")
    parts = num_partitions(block_tables, k_cache.shape[1], partition_size)
    if parts > MAX_PARTITIONS:
        raise ValueError(f"block_tables: {block_tables.shape[1]} blocks make {parts} partitions of {partition_size} "
                         f"tokens, more than {MAX_PARTITIONS}")
    dev = q.device
    if parts > 1:
        part_out = torch.empty((num_seqs, num_heads, parts, head_dim), dtype=torch.float32, device=dev)
        part_max = torch.empty((num_seqs, num_heads, parts), dtype=torch.float32, device=dev)
        part_sum = torch.empty_like(part_max)
    else:  # unused by the kernel; only their partition dim (1) is read
        part_out = torch.empty((0, 0, 1, 0), dtype=torch.float32, device=dev)
        part_max = part_sum = torch.empty((0, 0, 1), dtype=torch.float32, device=dev)
    torch.ops.splitserve.paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, float(scale),
                                                partition_size, part_out, part_max, part_sum)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k_cache / v_cache at slot_mapping[t] = k[t] / v[t]; tokens with slot -1 are skipped."""
    check_cache_write(k, v, k_cache, v_cache, slot_mapping)
    if k_cache.device.type != "cuda":
        raise ValueError(f"k_cache: must be a CUDA tensor, got one on {k_cache.device}")
    torch.ops.splitserve.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def _block_ids(block_ids: Sequence[int] | torch.Tensor, kv_caches: torch.Tensor) -> torch.Tensor:
    """Checked on the CPU (no device sync), then copied to the cache's device."""
    ids = torch.as_tensor(block_ids, dtype=torch.long, device="cpu").reshape(-1)
    num_blocks = kv_caches.shape[2]
    if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < num_blocks):
        raise ValueError(f"block_ids: must be in [0, {num_blocks}), got {ids.min().item()}..{ids.max().item()}")
    return ids.to(kv_caches.device, non_blocking=True)


def _check_block_copy(kv_caches: torch.Tensor, packed: torch.Tensor, n: int) -> None:
    if kv_caches.dim() != 6 or kv_caches.shape[1] != 2 or not kv_caches.is_contiguous():
        raise ValueError("kv_caches: must be a contiguous [num_layers, 2, num_blocks, block_size, kv_heads, "
                         f"head_dim] tensor, got shape {tuple(kv_caches.shape)}")
    if kv_caches.device.type != "cuda":
        raise ValueError(f"kv_caches: must be a CUDA tensor, got one on {kv_caches.device}")
    want = (n, kv_caches.shape[0], 2, *kv_caches.shape[3:])
    if tuple(packed.shape) != want or packed.dtype != kv_caches.dtype or packed.device != kv_caches.device \
            or not packed.is_contiguous():
        raise ValueError(f"packed: must be a contiguous {kv_caches.dtype} {list(want)} tensor on {kv_caches.device}, "
                         f"got {packed.dtype} {list(packed.shape)} on {packed.device}")
    if n > 0 and kv_caches.shape[0] * 2 > MAX_GRID_YZ:
        raise ValueError(f"kv_caches: at most {MAX_GRID_YZ // 2} layers, got {kv_caches.shape[0]}")


def pack_blocks(kv_caches: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The blocks gathered into one contiguous ``packed`` tensor (optionally into ``out``)."""
    ids = _block_ids(block_ids, kv_caches)
    if out is None:
        out = torch.empty((len(ids), kv_caches.shape[0], 2, *kv_caches.shape[3:]), dtype=kv_caches.dtype,
                          device=kv_caches.device)
    _check_block_copy(kv_caches, out, len(ids))
    torch.ops.splitserve.pack_blocks(kv_caches, ids, out)
    return out


def unpack_blocks(packed: torch.Tensor, kv_caches: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> None:
    """Scatters ``packed`` back: kv_caches[:, :, block_ids[i]] = packed[i]. Ids must be distinct."""
    ids = _block_ids(block_ids, kv_caches)
    _check_block_copy(kv_caches, packed, len(ids))
    torch.ops.splitserve.unpack_blocks(packed, ids, kv_caches)
