"""Where a node's KV block pool lives and how big it is, over every rank: what
``GET /debug/state`` and the metrics report of it (node/runtime.py computes it once the
engine is built). Must not: touch the KV cache's contents.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..common.config import EngineConfig
from ..common.kv_compat import KVCompat
from ..kvtransfer.layout import KVShard


class KVPoolInfo(NamedTuple):
    """Where the node's KV block pool lives and how big it is (/debug/state, metrics)."""
    device: str  # torch device, e.g. "cpu", "cuda:0" (rank 0's)
    dtype: str  # "float32", "bfloat16", ...
    blocks: int  # usable blocks (the tensor may hold one more: static decode's scratch block)
    bytes: int  # every rank's KV cache together
    tokens: int
    gpu_memory_utilization: float | None  # the fraction it was sized from, if any (per rank)
    # [rank] -> {"rank", "kv_heads": [start, stop), "bytes"}: each rank holds its KV heads of every block
    ranks: tuple[dict, ...] = ()

    @classmethod
    def of(cls, kv: torch.Tensor, blocks: int, kv_key: KVCompat, tp: int, cfg: EngineConfig) -> KVPoolInfo:
        """The pool of ``blocks`` usable blocks whose rank 0 holds ``kv``, each of the ``tp``
        ranks its KV heads of every block (``kv_key``'s split)."""
        shards = [KVShard(kv_key, r) for r in range(tp)]
        rank_bytes = [blocks * shard.layout.block_nbytes for shard in shards]
        ranks = tuple({"rank": r, "kv_heads": list(shard.heads), "bytes": nbytes}
                      for r, (shard, nbytes) in enumerate(zip(shards, rank_bytes)))
        return cls(device=str(kv.device), dtype=str(kv.dtype).removeprefix("torch."), blocks=blocks,
                   bytes=sum(rank_bytes), tokens=blocks * cfg.block_size,
                   gpu_memory_utilization=cfg.gpu_memory_utilization, ranks=ranks)
