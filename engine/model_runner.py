"""ModelRunner: owns the model weights and the paged KV cache tensor, turns a
SchedulerOutput into one forward pass, and samples.

The KV pool is sized and allocated by engine/kv_pool.py (kv_cache_memory, or on a GPU
gpu_memory_utilization after a profiled dummy forward):

    bytes per block = num_layers * 2 (K, V) * block_size * kv_heads * head_dim * dtype bytes
    num_blocks      = pool budget // bytes per block

The cache tensor holds one block more, the scratch block (index ``num_blocks``), which
the block pool never hands out: padding rows of a static decode batch write there.

Decode-only steps go through ``StaticDecode`` (decode_graphs.py: padded to a batch-size
bucket, a CUDA graph per bucket on a GPU) unless ``enforce_eager``; steps with a prefill
chunk, and decode batches larger than the largest bucket, run eagerly at their exact shape.

What overlaps on CUDA: input copies are non-blocking from pinned buffers, and the
forward (a graph replay) and the sampler are queued without waiting, so the host
builds the sampler's per-row tensors while the GPU computes. The one wait per step is
the sampler's copy of the sampled ids to the host: stop checks and the next step's
input ids need them, so step N+1 cannot be scheduled before step N's tokens land.
"""

import logging
from typing import Callable, NamedTuple

import torch

from ..common.config import EngineConfig
from ..common.sampling_params import TokenLogprobs
from .attention.base import AttentionMetadata
from .attention.prefill_batch import ChunkSpec, build_prefill_groups, varlen_available
from .attention.selector import select_backend
from .attention.torch_backend import build_decode_mask
from .decode_graphs import StaticDecode, default_graph_sizes
from .kv_cache_manager import KVCacheManager
from .kv_pool import allocate_pool, kv_block_bytes, plan_pool  # noqa: F401 (re-export)
from .loader import load_model
from .model_config import ModelConfig
from .sampler import Sampler
from .scheduler import SchedulerOutput
from .structured import GrammarMasker

log = logging.getLogger(__name__)

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
        self.scratch_block = self.num_blocks  # padding rows of static decode write here
        # [num_layers, 2, num_blocks + 1, block_size, kv_heads, head_dim]
        self.kv_caches = allocate_pool(cfg, self.kv_pool._replace(num_blocks=self.num_blocks + 1), config,
                                       self.dtype, self.device, kv_cache_factory)
        self.sampler = Sampler(seed=config.seed)
        self.grammar_masker: GrammarMasker | None = None  # made for the first structured request
        self.prefill_varlen = varlen_available(self.device, self.dtype)  # one attention call for all chunks
        self.static_decode = None if config.enforce_eager else self._static_decode()

    def _static_decode(self) -> StaticDecode:
        cfg, config = self.model_config, self.config
        sizes = config.cuda_graph_sizes or default_graph_sizes(config.max_num_seqs)
        max_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        use_graphs = self.device.type == "cuda" and not self.backend.needs_decode_mask
        if self.device.type == "cuda" and not use_graphs:
            log.warning("attention backend %s builds a decode mask per step: decode runs padded "
                        "but without CUDA graphs", self.backend.name)
        return StaticDecode(self.model, self.kv_caches, self.backend, sizes, -(-max_len // config.block_size),
                            self.scratch_block, use_graphs)

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> StepResult:
        """Run one forward pass over ``out.scheduled`` and sample for every request
        whose scheduled tokens reach the end of its sequence."""
        bs = self.config.block_size
        decodes = [(r, n) for r, n in out.scheduled if n == 1]
        prefills = [(r, n) for r, n in out.scheduled if n > 1]
        if not prefills and self.static_decode is not None and self.static_decode.bucket(len(decodes)):
            return self._execute_static(decodes, kv)
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
            pos = torch.arange(start + n)
            key_slots = table[pos // bs] * bs + pos % bs  # [start + n]: the context, then the new tokens
            chunks.append(ChunkSpec(len(ids), n, start, key_slots))
            ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(key_slots[start:].tolist())
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
            prefills=build_prefill_groups(chunks, dev, self.prefill_varlen),
        )
        logits = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                            self.kv_caches, meta, self.backend,
                            torch.tensor(logits_rows, dtype=torch.long, device=dev))
        return StepResult(self._sample(logits, sampling_reqs), len(ids))

    def _execute_static(self, decodes, kv: KVCacheManager) -> StepResult:
        """A decode-only step through the padded fixed-shape forward."""
        reqs = [r for r, _ in decodes]
        positions = [r.num_computed_tokens for r in reqs]
        logits = self.static_decode.run([r.all_token_ids[p] for r, p in zip(reqs, positions)], positions,
                                        [kv.block_ids(r.request_id) for r in reqs])  # [D, vocab]
        # a 1-token chunk in the middle of a prompt computes KV but samples nothing
        rows = [i for i, (r, p) in enumerate(zip(reqs, positions)) if p + 1 == r.num_tokens]
        if len(rows) < len(reqs):
            logits = logits[rows]
        return StepResult(self._sample(logits, [reqs[i] for i in rows]), len(reqs))

    def _sample(self, logits: torch.Tensor, reqs: list) -> list[tuple[str, int, TokenLogprobs | None]]:
        """logits [S, vocab], row i for reqs[i] -> (req_id, token, logprobs) per request."""
        if not reqs:
            return []
        if any(r.grammar is not None for r in reqs):  # structured outputs: refused tokens -> -inf
            if self.grammar_masker is None:
                self.grammar_masker = GrammarMasker(logits.shape[1], logits.device)
            logits = self.grammar_masker(logits, [r.grammar for r in reqs])
        res = self.sampler(logits, reqs)
        return [(r.request_id, t, lp) for r, t, lp in zip(reqs, res.token_ids, res.logprobs)]
