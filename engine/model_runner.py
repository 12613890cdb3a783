"""ModelRunner: owns the model weights and the paged KV cache tensor, turns a
SchedulerOutput into one forward pass, and samples.

The KV pool is sized and allocated by engine/kv_pool.py (kv_cache_memory, or on a GPU
gpu_memory_utilization after a profiled dummy forward):

    bytes per block = num_layers * 2 (K, V) * block_size * kv_heads * head_dim * dtype bytes
    num_blocks      = pool budget // bytes per block
"""

from typing import Callable, NamedTuple

import torch

from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import TokenLogprobs
from splitserve.engine.attention.base import AttentionMetadata, PrefillChunk
from splitserve.engine.attention.selector import select_backend
from splitserve.engine.attention.torch_backend import build_decode_mask
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.kv_pool import allocate_pool, kv_block_bytes, plan_pool  # noqa: F401 (re-export)
from splitserve.engine.loader import load_model
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import SchedulerOutput

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StepResult(NamedTuple):
    sampled: list[tuple[str, int, TokenLogprobs | None]]  # (req_id, token, logprobs), requests that reached their end
    num_tokens: int  # tokens computed this step


KVCacheFactory = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # (shape, dtype) -> zeroed tensor


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir, kv_cache_factory: KVCacheFactory | None = None):
        """``kv_cache_factory`` lets a node place the cache (e.g. in shared memory for
        a same-host KV transport); by default a plain tensor on ``config.device``."""
        self.config = config
        self.dtype = _DTYPES[config.dtype]
        self.device = torch.device(config.device)
        self.model = load_model(model_dir, self.dtype, self.device, config.load_format)
        self.model_config: ModelConfig = self.model.cfg
        cfg = self.model_config
        self.backend = select_backend(config, self.device, cfg.head_dim)
        self.kv_pool = plan_pool(config, self.model, self.backend, self.dtype, self.device)
        self.num_blocks = self.kv_pool.num_blocks
        # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.kv_caches = allocate_pool(cfg, self.kv_pool, config, self.dtype, self.device, kv_cache_factory)
        self.sampler = Sampler(seed=config.seed)

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> StepResult:
        """Run one forward pass over ``out.scheduled`` and sample for every request
        whose scheduled tokens reach the end of its sequence."""
        bs = self.config.block_size
        decodes = [(r, n) for r, n in out.scheduled if n == 1]
        prefills = [(r, n) for r, n in out.scheduled if n > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampling_reqs = []

        tables = [kv.block_ids(r.request_id) for r, _ in decodes]
        for (req, _), table in zip(decodes, tables):
            pos = req.num_computed_tokens
            ids.append(req.all_token_ids[pos])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            if pos + 1 == req.num_tokens:  # else: the last 1-token chunk of a prompt mid-way
                logits_rows.append(len(ids) - 1)
                sampling_reqs.append(req)
        nd = len(decodes)
        max_blocks = max((len(t) for t in tables), default=1)
        decode_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables],
                                     dtype=torch.long).view(nd, max_blocks)
        seq_lens = torch.tensor([r.num_computed_tokens + 1 for r, _ in decodes], dtype=torch.long)
        decode_mask = (build_decode_mask(seq_lens, max_blocks * bs, self.dtype, self.device)
                       if self.backend.needs_decode_mask else None)  # the kernels read seq_lens instead

        chunks = []
        for req, n in prefills:
            start = req.num_computed_tokens
            table = torch.tensor(kv.block_ids(req.request_id), dtype=torch.long)
            pos = torch.arange(start, start + n)
            chunks.append(PrefillChunk(len(ids), n, start, table.to(self.device)))
            ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend((table[pos // bs] * bs + pos % bs).tolist())
            if start + n == req.num_tokens:
                logits_rows.append(len(ids) - 1)
                sampling_reqs.append(req)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=nd,
            decode_block_tables=decode_tables.to(dev),
            decode_seq_lens=seq_lens.to(dev),
            decode_mask=decode_mask,
            prefills=chunks,
        )
        logits = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                            self.kv_caches, meta, self.backend,
                            torch.tensor(logits_rows, dtype=torch.long, device=dev))
        sampled = []
        if sampling_reqs:
            res = self.sampler(logits, sampling_reqs)
            sampled = [(r.request_id, t, lp) for r, t, lp in zip(sampling_reqs, res.token_ids, res.logprobs)]
        return StepResult(sampled, len(ids))
