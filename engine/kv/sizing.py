"""Sizing and allocation of an engine's KV cache (the tensor of every KV block), on the
engine's device.

Owns: how many blocks the KV cache gets (from ``kv_cache_memory``, or on a GPU from
``gpu_memory_utilization`` after profiling one dummy forward), and allocating it. The
block pool (block_pool.py) keeps the books of those blocks; this module only sizes them.
Must not: run the engine's steps, or know about transfers or nodes.

Sizing with ``gpu_memory_utilization = F`` (the fraction of the device's *total* memory
this process may use, as vLLM users know it; two nodes sharing a GPU each take a share)::

    total ............................................................. device memory
    F * total ........................................ this process's budget
      - weights          torch.cuda.memory_allocated() once the model is loaded
      - activation peak  max_memory_allocated() over one dummy forward of
                         max_num_batched_tokens prompt tokens, minus the weights
                         and the forward's scratch cache
      = KV cache bytes  ->  num_blocks = KV cache bytes // block bytes

The KV cache must also fit in the memory the device has free right now (other processes
count there); if it does not, the error says how much is free and what was asked.

Tensor parallelism: each rank sizes its own cache (its KV heads, its device, the same
budget per rank) and every rank takes the smallest block count of the group (one
``min_int``), so block ids mean the same slot on every rank; a rank that cannot size
its cache makes every rank raise.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch

from ...common.config import EngineConfig
from ..attention.base import AttentionMetadata
from ..attention.prefill_batch import ChunkSpec, build_prefill_groups, varlen_available
from ..models.config import ModelConfig
from ..parallel.group import INIT_TIMEOUT_S, TPGroup

log = logging.getLogger(__name__)

MIN_BLOCKS = 2


class KVCacheSize(NamedTuple):
    num_blocks: int
    block_bytes: int  # one block of all layers, K and V
    budget_bytes: int  # memory granted to the KV cache (num_blocks * block_bytes <= budget)
    weights_bytes: int | None  # measured on a GPU with gpu_memory_utilization, else None
    activation_peak_bytes: int | None


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """One block of all layers, K and V, holding ``num_kv_heads`` heads (default: all the model's)."""
    per_head = cfg.kv_bytes_per_token(dtype.itemsize) // cfg.num_kv_heads
    return block_size * per_head * (cfg.num_kv_heads if num_kv_heads is None else num_kv_heads)


def gpu_kv_cache_budget(total: int, utilization: float, weights: int, activation_peak: int,
                        free: int) -> int:
    """Bytes for the KV cache under ``gpu_memory_utilization``; raises ``ValueError`` naming the
    field when nothing is left or the device has not that much free memory now."""
    budget = int(total * utilization) - weights - activation_peak
    gib = 1 << 30
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization: {utilization} of {total / gib:.1f} GiB leaves nothing for "
                         f"the KV cache after the weights ({weights / gib:.2f} GiB) and the activation "
                         f"peak ({activation_peak / gib:.2f} GiB); raise it or lower max_num_batched_tokens")
    if budget > free:
        raise ValueError(f"gpu_memory_utilization: the KV cache would take {budget / gib:.2f} GiB but the "
                         f"device has {free / gib:.2f} GiB free (other processes use it); lower "
                         f"--gpu-memory-utilization or give --kv-cache-memory")
    return budget


def dummy_forward(model, backend, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Run one prefill of ``max_num_batched_tokens`` tokens through ``model`` into a scratch
    cache (freed on return); returns the scratch cache's bytes. Runs on any device."""
    cfg, bs, n = model.cfg, config.block_size, config.max_num_batched_tokens
    blocks = math.ceil(n / bs)
    # [num_layers, 2, blocks, block_size, kv_heads (this rank's), head_dim]
    cache = torch.zeros((cfg.num_layers, 2, blocks, bs, model.shard.num_kv_heads, cfg.head_dim), dtype=dtype,
                        device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device), num_decodes=0,
        decode_block_tables=torch.zeros((0, 1), dtype=torch.long, device=device),
        decode_seq_lens=torch.zeros(0, dtype=torch.long, device=device), decode_mask=None,
        prefills=build_prefill_groups([ChunkSpec(0, n, 0, torch.arange(n))], device,
                                      varlen_available(device, dtype)))  # as the engine's prefill runs
    ids = torch.zeros(n, dtype=torch.long, device=device)
    with torch.inference_mode():
        model(ids, torch.arange(n, device=device), cache, meta, backend,
              torch.tensor([n - 1], dtype=torch.long, device=device))
    return cache.numel() * cache.element_size()


def size_kv_cache(config: EngineConfig, model, backend, dtype: torch.dtype, device: torch.device,
                  group: TPGroup | None = None) -> KVCacheSize:
    """The KV cache's size for ``config`` (call after the model is loaded, before the cache
    exists); with a ``group`` of several ranks, every rank of it calls this together."""
    block = kv_block_bytes(model.cfg, config.block_size, dtype, model.shard.num_kv_heads)
    weights = peak = None
    failed: ValueError | None = None
    if config.gpu_memory_utilization is None:
        budget = config.kv_cache_memory
        field = "kv_cache_memory"
    else:  # EngineConfig refuses it on the CPU
        torch.cuda.synchronize(device)
        weights = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        scratch = dummy_forward(model, backend, config, dtype, device)
        torch.cuda.synchronize(device)
        peak = max(0, torch.cuda.max_memory_allocated(device) - weights - scratch)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        field = "gpu_memory_utilization"
        try:
            budget = gpu_kv_cache_budget(total, config.gpu_memory_utilization, weights, peak, free)
        except ValueError as e:  # raised after the group agreed, so no rank waits for this one
            failed, budget = e, 0
    num_blocks = local = budget // block
    if group is not None and group.size > 1:  # every rank calls this, ranks finish loading at their pace
        num_blocks = group.min_int(local, timeout_s=INIT_TIMEOUT_S)
        budget = min(budget, num_blocks * block)
    if failed is not None:
        raise failed
    if num_blocks < min(local, MIN_BLOCKS):
        raise ValueError(f"{field}: another tensor-parallel rank's KV cache holds only {num_blocks} blocks "
                         f"(see that rank's log)")
    if num_blocks < MIN_BLOCKS:
        raise ValueError(f"{field}: {budget} bytes for the KV cache hold fewer than {MIN_BLOCKS} blocks of "
                         f"{block} bytes; raise it")
    size = KVCacheSize(num_blocks, block, budget, weights, peak)
    if weights is not None and peak is not None:  # measured (gpu_memory_utilization)
        gib = 1 << 30
        log.info("KV cache on %s: %d blocks (%.2f GiB) from gpu_memory_utilization %.2f; weights %.2f GiB, "
                 "activation peak %.2f GiB", device, num_blocks, num_blocks * block / gib,
                 config.gpu_memory_utilization, weights / gib, peak / gib)
    return size


def new_kv_cache(model_cfg: ModelConfig, size: KVCacheSize, config: EngineConfig, dtype: torch.dtype,
                 device: torch.device, factory=None, num_kv_heads: int | None = None) -> torch.Tensor:
    """The zeroed KV cache ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`` on ``device``,
    or from ``factory(shape, dtype)`` when the node places it (shared memory). ``kv_heads``:
    ``num_kv_heads`` (a rank's), default all the model's."""
    cfg = model_cfg
    heads = cfg.num_kv_heads if num_kv_heads is None else num_kv_heads
    shape = (cfg.num_layers, 2, size.num_blocks, config.block_size, heads, cfg.head_dim)
    if factory is not None:
        return factory(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
