"""ModelRunner: owns the model weights and the paged KV cache tensor, turns a
SchedulerOutput into one forward pass, and samples.

The KV cache is sized and allocated by engine/kv_sizing.py (kv_cache_memory, or on a GPU
gpu_memory_utilization after a profiled dummy forward):

    bytes per block = num_layers * 2 (K, V) * block_size * kv_heads * head_dim * dtype bytes
    num_blocks      = KV cache budget // bytes per block

The cache tensor holds one block more, the scratch block (index ``num_blocks``), which
the block pool never hands out: padding rows of a static decode batch write there.

Decode-only steps go through ``StaticDecode`` (decode_graphs.py: padded to a batch-size
bucket, a CUDA graph per bucket on a GPU) unless ``enforce_eager``; steps with a prefill
chunk, and decode batches larger than the largest bucket, run eagerly at their exact shape.

``launch`` queues a step and returns without waiting for the device: input copies are
non-blocking from pinned memory (engine/upload.py), the forward (a graph replay) and
the sampler are queued, and so is the one device-to-host copy of the sampled ids. The
returned ``LaunchedStep.result()`` waits for that copy. The engine schedules and
launches step N+1 before it waits for step N (async scheduling): a decode row whose
input token step N sampled (``Request.pending_tokens``) reads that id from step N's
device tensor, so the host never needs it to build step N+1.
"""

import logging
from typing import Callable, NamedTuple, Sequence

import torch

from ..common.config import EngineConfig
from ..common.sampling_params import PromptLogprob, TokenLogprobs
from . import prompt_logprobs
from .attention.base import AttentionMetadata
from .attention.prefill_batch import ChunkSpec, build_prefill_groups, varlen_available
from .attention.selector import select_backend
from .attention.torch_backend import build_decode_mask
from .decode_graphs import StaticDecode, default_graph_sizes
from .kv_cache_manager import KVCacheManager
from .kv_sizing import kv_block_bytes, new_kv_cache, size_kv_cache  # noqa: F401 (kv_block_bytes: re-export)
from .loader import load_model
from .model_config import ModelConfig
from .prompt_logprobs import PromptRows
from .request import Request
from .sampler import SampledTokens, Sampler
from .scheduler import SchedulerOutput
from .structured import GrammarMasker
from .upload import upload

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StepResult(NamedTuple):
    sampled: list[tuple[Request, int, TokenLogprobs | None]]  # requests that reached their end
    num_tokens: int  # tokens computed this step
    # (request, first position, values) of the chunks whose requests asked for prompt logprobs
    prompt_logprobs: Sequence[tuple[Request, int, list[PromptLogprob]]] = ()


class LaunchedStep(NamedTuple):
    """A step queued on the device; ``result()`` waits for its sampled tokens."""
    requests: list[Request]  # those that sample, in the order of ``tokens``
    tokens: SampledTokens | None  # None when no request samples
    num_tokens: int
    prompt_logprobs: Sequence[tuple[Request, int, list[PromptLogprob]]] = ()

    def result(self) -> StepResult:
        if self.tokens is None:
            return StepResult([], self.num_tokens, self.prompt_logprobs)
        out = self.tokens.to_host()
        return StepResult(list(zip(self.requests, out.token_ids, out.logprobs)), self.num_tokens,
                          self.prompt_logprobs)


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
        self.kv_size = size_kv_cache(config, self.model, self.backend, self.dtype, self.device)
        self.num_blocks = self.kv_size.num_blocks
        self.scratch_block = self.num_blocks  # padding rows of static decode write here
        # [num_layers, 2, num_blocks + 1, block_size, kv_heads, head_dim]
        self.kv_caches = new_kv_cache(cfg, self.kv_size._replace(num_blocks=self.num_blocks + 1), config,
                                       self.dtype, self.device, kv_cache_factory)
        self.sampler = Sampler(seed=config.seed)
        self.grammar_masker: GrammarMasker | None = None  # made for the first structured request
        self.prefill_varlen = varlen_available(self.device, self.dtype)  # one attention call for all chunks
        self.static_decode = None if config.enforce_eager else self._static_decode()
        self._last: dict[str, tuple[Request, int]] = {}  # the last launch's samplers -> row of ...
        self._last_tokens: torch.Tensor | None = None  # ... its sampled ids [S], on the device

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

    def launch(self, out: SchedulerOutput, kv: KVCacheManager) -> LaunchedStep:
        """Queue one forward pass over ``out.scheduled`` and sampling for every request
        whose scheduled tokens reach the end of its sequence (``seq_len``)."""
        decodes = [(r, n) for r, n in out.scheduled if n == 1]
        prefills = [(r, n) for r, n in out.scheduled if n > 1]
        if not prefills and self.static_decode is not None and self.static_decode.bucket(len(decodes)):
            step = self._launch_static(decodes, kv)
        else:
            step = self._launch_eager(decodes, prefills, kv)
        self._last = {r.request_id: (r, i) for i, r in enumerate(step.requests)}
        self._last_tokens = None if step.tokens is None else step.tokens.token_ids
        return step

    def _from_last(self, req: Request, pos: int) -> int:
        """-1 if ``req``'s input id at ``pos`` is on the host, else its row in the last launch's tokens."""
        if pos < req.num_tokens:
            return -1
        last, row = self._last[req.request_id]
        assert last is req and pos == req.num_tokens, (req.request_id, pos, req.num_tokens)
        return row

    def _launch_eager(self, decodes, prefills, kv: KVCacheManager) -> LaunchedStep:
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampling_reqs = []
        prompt_rows: list[PromptRows] = []  # chunks whose logits give prompt logprobs

        from_last: list[tuple[int, int]] = []  # (row, row of the last launch's tokens)
        tables = [kv.block_ids(r.request_id) for r, _ in decodes]
        for (req, _), table in zip(decodes, tables):
            pos = req.num_computed_tokens
            src = self._from_last(req, pos)
            if src >= 0:
                from_last.append((len(ids), src))
            ids.append(req.all_token_ids[pos] if src < 0 else 0)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            if pos + 1 == req.seq_len:  # else: the last 1-token chunk of a prompt mid-way
                logits_rows.append(len(ids) - 1)
                sampling_reqs.append(req)
            elif _wants_prompt_logprobs(req, pos, 1):
                prompt_rows.append(PromptRows(req, pos, [len(ids) - 1]))
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
            block_table = torch.tensor(kv.block_ids(req.request_id), dtype=torch.long)
            pos = torch.arange(start + n)
            key_slots = block_table[pos // bs] * bs + pos % bs  # [start + n]: the context, then the new tokens
            chunks.append(ChunkSpec(len(ids), n, start, key_slots))
            if m := _wants_prompt_logprobs(req, start, n):
                prompt_rows.append(PromptRows(req, start, list(range(len(ids), len(ids) + m))))
            ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(key_slots[start:].tolist())
            if start + n == req.seq_len:
                logits_rows.append(len(ids) - 1)
                sampling_reqs.append(req)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=upload(slots, dev, torch.long),
            num_decodes=nd,
            decode_block_tables=upload(decode_tables, dev),
            decode_seq_lens=upload(seq_lens, dev),
            decode_mask=decode_mask,
            prefills=build_prefill_groups(chunks, dev, self.prefill_varlen),
        )
        input_ids = upload(ids, dev, torch.long)
        if from_last:
            assert self._last_tokens is not None, "rows read from the last launch's tokens"
            dst_rows, src_rows = [d for d, _ in from_last], [s for _, s in from_last]
            input_ids.index_copy_(0, upload(dst_rows, dev), self._last_tokens[upload(src_rows, dev)])
        extra = [row for c in prompt_rows for row in c.rows]  # after the sampling rows
        logits = self.model(input_ids, upload(positions, dev, torch.long), self.kv_caches, meta, self.backend,
                            upload(logits_rows + extra, dev, torch.long))
        at, prompt = len(logits_rows), []
        for c in prompt_rows:  # [len(c.rows), V] each, in order after the sampling rows
            prompt.append(_prompt_chunk(c, logits[at:at + len(c.rows)]))
            at += len(c.rows)
        return LaunchedStep(sampling_reqs, self._sample(logits[:len(logits_rows)], sampling_reqs), len(ids), prompt)

    def _launch_static(self, decodes, kv: KVCacheManager) -> LaunchedStep:
        """A decode-only step through the padded fixed-shape forward."""
        assert self.static_decode is not None, "launch() takes this path only with static decode on"
        reqs = [r for r, _ in decodes]
        positions = [r.num_computed_tokens for r in reqs]
        src = [self._from_last(r, p) for r, p in zip(reqs, positions)]
        ids = [r.all_token_ids[p] if s < 0 else 0 for r, p, s in zip(reqs, positions, src)]
        from_last = None
        if max(src) >= 0:
            assert self._last_tokens is not None, "rows read from the last launch's tokens"
            from_last = (src, self._last_tokens)
        logits = self.static_decode.run(ids, positions, [kv.block_ids(r.request_id) for r in reqs],
                                        from_last)  # [D, vocab]
        # a 1-token chunk in the middle of a prompt computes KV but samples nothing
        rows = [i for i, (r, p) in enumerate(zip(reqs, positions)) if p + 1 == r.seq_len]
        prompt = [_prompt_chunk(PromptRows(r, p, [i]), logits[i:i + 1])
                  for i, (r, p) in enumerate(zip(reqs, positions))
                  if p + 1 < r.seq_len and _wants_prompt_logprobs(r, p, 1)]
        if len(rows) < len(reqs):
            logits = logits[upload(rows, logits.device)]
        sampling_reqs = [reqs[i] for i in rows]
        return LaunchedStep(sampling_reqs, self._sample(logits, sampling_reqs), len(reqs), prompt)

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> SampledTokens | None:
        """logits [S, vocab], row i for reqs[i]; None when nothing samples."""
        if not reqs:
            return None
        if any(r.grammar is not None for r in reqs):  # structured outputs: refused tokens -> -inf
            if self.grammar_masker is None:
                self.grammar_masker = GrammarMasker(logits.shape[1], logits.device)
            logits = self.grammar_masker(logits, [r.grammar for r in reqs])
        return self.sampler.sample(logits, reqs)


def _wants_prompt_logprobs(req, start: int, n: int) -> int:
    """Rows of the chunk [start, start + n) that give ``req`` prompt logprobs (0: none)."""
    if req.sampling_params.prompt_logprobs is None:
        return 0
    return prompt_logprobs.wanted_positions(len(req.prompt_token_ids), start, n)


def _prompt_chunk(c: PromptRows, logits: torch.Tensor) -> tuple[Request, int, list[PromptLogprob]]:
    """logits [len(c.rows), V] -> (request, first position, its prompt logprobs)."""
    req, k = c.request, c.request.sampling_params.prompt_logprobs
    assert k is not None, "only requests that asked have PromptRows (_wants_prompt_logprobs)"
    targets = req.prompt_token_ids[c.start + 1:c.start + 1 + len(c.rows)]
    return req, c.start, prompt_logprobs.compute(logits, targets, k)
