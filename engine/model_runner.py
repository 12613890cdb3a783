"""ModelRunner: owns the model weights and the paged KV cache tensor, turns a
SchedulerOutput into one forward pass, and samples.

The KV cache is sized and allocated by engine/kv/sizing.py (kv_cache_memory, or on a GPU
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
returned ``LaunchedStep.result()`` (runner.py) waits for that copy. The engine schedules and
launches step N+1 before it waits for step N (async scheduling): a decode row whose
input token step N sampled (``Request.pending_tokens``) reads that id from step N's
device tensor, so the host never needs it to build step N+1.

Tensor parallelism: every rank of a node has a ModelRunner over its shard, built from
the same config, in step (its KV cache holds the rank's KV heads of every block, with
the same block ids)::

    rank 0   launch: plan on the host (ForwardInputs, step_inputs.py) -> link.send_step
                     -> execute (collectives inside) -> sample -> [broadcast sampled ids]
    worker   follow: execute (the same inputs)                      -> [receive them]

Only rank 0 samples. The bracketed broadcast runs under async scheduling only: the next
step's rows that read the ids on the device (``from_last``) then find them on every rank.
"""

import logging
from typing import Callable, NamedTuple, Protocol

import torch

from ..common.config import EngineConfig
from ..common.sampling_params import PromptLogprob
from .sampling import prompt_logprobs
from .attention.base import AttentionMetadata
from .attention.prefill_batch import ChunkSpec, build_prefill_groups, varlen_available
from .attention.selector import select_backend
from .attention.torch_backend import TorchAttention, build_decode_mask
from .decode_graphs import StaticDecode, default_graph_sizes
from .kv.cache_manager import KVCacheManager
from .kv.sizing import kv_block_bytes, new_kv_cache, size_kv_cache  # noqa: F401 (kv_block_bytes: re-export)
from .models.loader import load_model
from .models.moe import expert_load_imbalance
from .models.config import ModelConfig
from .parallel.group import TPGroup
from .request import Request
from .runner import LaunchedStep, Runner, split
from .sampling.sampler import SampledTokens, Sampler
from .scheduler import Row, SchedulerOutput
from .step_inputs import ForwardInputs, PrefillChunk
from .sampling.structured import GrammarMasker
from .upload import upload

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


KVCacheFactory = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # (shape, dtype) -> zeroed tensor


class PromptRows(NamedTuple):
    """Logits rows of one chunk whose positions predict prompt tokens (sampling/prompt_logprobs.py)."""

    request: Request
    start: int  # position of the first row
    rows: list[int]  # indices into the step's flat token batch, consecutive positions


class StepLink(Protocol):
    """How rank 0's runner reaches the worker ranks (ranks/launch.py ``TPLeader``): every step's inputs,
    sent before rank 0 runs the same forward."""

    def send_step(self, inputs: ForwardInputs) -> None: ...


class _Plan(NamedTuple):
    """Rank 0's host-side view of a step: what to send, and what to do with its logits."""
    inputs: ForwardInputs
    verifying: list[Row]  # rows that sample, in order
    sampling_reqs: list[Request]  # each logits row's that samples: a row's request num_verify times
    sample_rows: list[int] | None  # rows of the logits that sample; None: the first len(sampling_reqs)
    prompt: list[tuple[PromptRows, int]]  # (chunk, its first row in the logits)
    num_tokens: int


class ModelRunner(Runner):
    def __init__(self, config: EngineConfig, model_dir, kv_cache_factory: KVCacheFactory | None = None,
                 group: TPGroup | None = None, link: StepLink | None = None):
        """``kv_cache_factory`` lets a node place the cache (e.g. in shared memory for
        a same-host KV transport); by default a plain tensor on ``config.device``.
        ``group``: this rank's TP group (None: TP=1); rank 0 also gets the ``link`` to
        its workers, which run ``follow`` for every step rank 0 ``launch``es."""
        self.config = config
        self.dtype = _DTYPES[config.dtype]
        self.group = group if group is not None else TPGroup.single(config.device, config.enable_expert_parallel)
        if self.group.data_parallel is not None and self.group.size > 1:
            raise ValueError("data_parallel_size: a data-parallel rank runs tensor_parallel_size 1")
        self.device = torch.device(config.device) if self.group.size == 1 else self.group.device
        self.link = link
        self.model = load_model(model_dir, self.dtype, self.device, config.load_format, self.group)
        self.model_config: ModelConfig = self.model.cfg
        self.shard = self.model.shard  # this rank's heads (shard.kv_heads: the KV heads its cache holds)
        cfg = self.model_config
        # MLA (models/mla.py) attends itself: the torch backend's metadata (decode masks, masked groups)
        self.backend = TorchAttention() if cfg.mla is not None else select_backend(config, self.device, cfg.head_dim)
        self.kv_size = size_kv_cache(config, self.model, self.backend, self.dtype, self.device, self.group)
        self.num_blocks = self.kv_size.num_blocks
        self.overrun_s = 0.0  # a real forward takes what it takes: there is no modelled time to overrun
        self.scratch_block = self.num_blocks  # padding rows of static decode write here
        # [num_layers, 2, num_blocks + 1, block_size, kv_heads (this rank's), head_dim]
        self.kv_caches = new_kv_cache(cfg, self.kv_size._replace(num_blocks=self.num_blocks + 1), config,
                                       self.dtype, self.device, kv_cache_factory, self.shard.num_kv_heads)
        self.sampler = Sampler(seed=config.seed)
        self.grammar_masker: GrammarMasker | None = None  # made for the first structured request
        # one attention call for all chunks
        self.prefill_varlen = cfg.mla is None and varlen_available(self.device, self.dtype)
        self.static_decode = None if config.enforce_eager else self._static_decode()
        # async scheduling over several ranks: the ids rank 0 samples reach every rank's device
        self.share_sampled = bool(config.async_scheduling) and self.group.size > 1
        self._last: dict[str, tuple[Request, int]] = {}  # rank 0: the last launch's samplers -> row of ...
        self._last_tokens: torch.Tensor | None = None  # ... its sampled ids [S], on the device (every rank)

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

    # ---- rank 0 ----------------------------------------------------------------------------
    def expert_load(self) -> dict[int, float]:
        return expert_load_imbalance(self.model)  # every rank routes alike: rank 0's counts are the node's

    def launch(self, out: SchedulerOutput, kv: KVCacheManager,
               ready: Callable[[], None] | None = None) -> LaunchedStep:
        """Queue one forward pass over ``out.rows`` and sampling at every row's last
        ``num_verify`` tokens (runner.py ``Runner.launch``). With TP, the
        workers get the step's inputs first and run the same forward. The step's lower-tier
        loads are issued first, one layer after another, and the forward waits for each
        layer's just before it (kv/tier_streams.py ``LayerLoads``). ``ready`` is called just
        before the forward is queued: what it queues reads the blocks in place, loaded ones
        included (with loads, it is queued behind them, beside the forward). A step of no rows
        only issues its loads (scheduler.py: a prompt loading a long run, nothing else to run)."""
        if not out.rows:
            loads = kv.take_loads()
            kv.before_forward()
            if loads is not None:
                loads.wait_all()
            if ready is not None:
                ready()
            return LaunchedStep([], None, 0)
        rows = split(out)
        if not rows.chunks and self.static_decode is not None and self.static_decode.bucket(len(rows.decodes)):
            plan = self._plan_static(rows.decodes, kv)
        else:
            plan = self._plan_eager(rows.decodes, rows.chunks, kv)
        if self.link is not None:
            self.link.send_step(plan.inputs)
        loads = kv.take_loads()  # this step's lower-tier loads, layer by layer
        kv.before_forward()  # stores still reading blocks this forward overwrites
        if ready is not None and loads is not None:
            loads.then(ready)
        elif ready is not None:
            ready()
        if loads is not None and plan.inputs.static:
            loads.wait_all()
        logits = self.execute(plan.inputs, None if loads is None else loads.wait)
        prompt = [_prompt_chunk(c, logits[at:at + len(c.rows)]) for c, at in plan.prompt]
        reqs = plan.sampling_reqs
        if plan.sample_rows is None:
            sample_logits = logits[:len(reqs)]
        else:
            sample_logits = logits[upload(plan.sample_rows, logits.device)]
        tokens = self._sample(sample_logits, reqs)
        if self.share_sampled and tokens is not None:
            self.group.broadcast(tokens.token_ids, src=0)  # queued on the stream: the host does not wait
        self._last = {r.request_id: (r, i) for i, r in enumerate(reqs)}
        self._last_tokens = None if tokens is None else tokens.token_ids
        return LaunchedStep(plan.verifying, tokens, plan.num_tokens, prompt)

    def _from_last(self, req: Request, pos: int) -> int:
        """-1 if ``req``'s input id at ``pos`` is on the host, else its row in the last launch's tokens."""
        if pos < req.num_tokens:
            return -1
        last, row = self._last[req.request_id]
        assert last is req and pos == req.num_tokens, (req.request_id, pos, req.num_tokens)
        return row

    def _plan_eager(self, decodes: list[Row], chunk_rows: list[Row], kv: KVCacheManager) -> _Plan:
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        verifying: list[Row] = []
        sampling_reqs: list[Request] = []
        prompt_rows: list[PromptRows] = []  # chunks whose logits give prompt logprobs (rows: flat batch)

        from_last: list[int] = []  # per decode row: row of the last launch's tokens, or -1
        tables = [kv.block_ids(r.request.request_id) for r in decodes]
        for row in decodes:
            req = row.request
            pos = req.num_computed_tokens
            src = self._from_last(req, pos)
            from_last.append(src)
            ids.append(req.all_token_ids[pos] if src < 0 else 0)
            positions.append(pos)
            if row.num_verify:  # else: a 1-token chunk of a prompt mid-way
                logits_rows.append(len(ids) - 1)
                verifying.append(row)
                sampling_reqs.append(req)
            elif _wants_prompt_logprobs(req, pos, 1):
                prompt_rows.append(PromptRows(req, pos, [len(ids) - 1]))

        chunks = []
        for row in chunk_rows:
            req, n = row.request, row.num_tokens
            start = req.num_computed_tokens
            table = kv.block_ids(req.request_id)[:-(-(start + n) // bs)]  # the blocks of [0, start + n)
            chunks.append(PrefillChunk(len(ids), n, start, table))
            if m := _wants_prompt_logprobs(req, start, n):
                prompt_rows.append(PromptRows(req, start, list(range(len(ids), len(ids) + m))))
            ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            if row.num_verify:
                logits_rows.extend(range(len(ids) - row.num_verify, len(ids)))
                verifying.append(row)
                sampling_reqs.extend([req] * row.num_verify)

        prompt, at = [], len(logits_rows)
        for c in prompt_rows:  # their logits come after the sampling rows, in order
            prompt.append((c, at))
            at += len(c.rows)
        extra = [row for c in prompt_rows for row in c.rows]
        inputs = ForwardInputs(False, ids, positions, tables, chunks, logits_rows + extra,
                               from_last if max(from_last, default=-1) >= 0 else [], len(sampling_reqs))
        return _Plan(inputs, verifying, sampling_reqs, None, prompt, len(ids))

    def _plan_static(self, decodes: list[Row], kv: KVCacheManager) -> _Plan:
        """A decode-only step through the padded fixed-shape forward (logits of every row)."""
        reqs = [r.request for r in decodes]
        positions = [r.num_computed_tokens for r in reqs]
        src = [self._from_last(r, p) for r, p in zip(reqs, positions)]
        ids = [r.all_token_ids[p] if s < 0 else 0 for r, p, s in zip(reqs, positions, src)]
        # a 1-token chunk in the middle of a prompt computes KV but samples nothing
        rows = [i for i, r in enumerate(decodes) if r.num_verify]
        prompt = [(PromptRows(r, p, [i]), i) for i, (r, p) in enumerate(zip(reqs, positions))
                  if not decodes[i].num_verify and _wants_prompt_logprobs(r, p, 1)]
        sampling_reqs = [reqs[i] for i in rows]
        inputs = ForwardInputs(True, ids, positions, [kv.block_ids(r.request_id) for r in reqs], [], [],
                               src if max(src) >= 0 else [], len(sampling_reqs))
        return _Plan(inputs, [decodes[i] for i in rows], sampling_reqs, None if len(rows) == len(reqs) else rows,
                     prompt, len(reqs))

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> SampledTokens | None:
        """logits [S, vocab], row i for reqs[i]; None when nothing samples."""
        if not reqs:
            return None
        if any(r.grammar is not None for r in reqs):  # structured outputs: refused tokens -> -inf
            if self.grammar_masker is None:
                self.grammar_masker = GrammarMasker(logits.shape[1], logits.device)
            logits = self.grammar_masker(logits, [r.grammar for r in reqs])
        return self.sampler.sample(logits, reqs)

    # ---- every rank --------------------------------------------------------------------------
    def follow(self, inputs: ForwardInputs) -> None:
        """A worker rank's step: the forward rank 0 runs for the same ``inputs`` (its logits
        unused), then, under async scheduling, rank 0's sampled ids for the next step."""
        self.execute(inputs)
        if not self.share_sampled:
            return
        if inputs.num_sampled:
            ids = torch.empty(inputs.num_sampled, dtype=torch.long, device=self.device)
            self._last_tokens = self.group.broadcast(ids, src=0)
        else:
            self._last_tokens = None

    def idle_forward(self) -> None:
        """A data-parallel rank with nothing scheduled while a peer steps: a forward of no
        tokens, which joins the MoE layers' collectives (ranks/data_parallel.py)."""
        assert self.group.data_parallel is not None, "only a data-parallel rank runs idle forwards"
        dev, none = self.device, torch.empty(0, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(slot_mapping=none, num_decodes=0,
                                 decode_block_tables=torch.empty(0, 1, dtype=torch.long, device=dev),
                                 decode_seq_lens=none, decode_mask=None, prefills=[])
        self.model(none, none, self.kv_caches, meta, self.backend, none)

    def execute(self, inputs: ForwardInputs, before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """The forward of one step on this rank's shard; logits [rows, vocab] float32 (every
        row for a static step, else ``inputs.logits_rows``). ``before_layer(i)``: called as
        an eager forward reaches layer i (a static step's loads are waited for before it)."""
        if inputs.static:
            assert self.static_decode is not None, "rank 0 plans static steps only with static decode on"
            from_last = None
            if inputs.from_last:
                assert self._last_tokens is not None, "rows read from the last launch's tokens"
                from_last = (inputs.from_last, self._last_tokens)
            return self.static_decode.run(inputs.input_ids, inputs.positions, inputs.decode_tables, from_last)
        return self._execute_eager(inputs, before_layer)

    def _execute_eager(self, inputs: ForwardInputs, before_layer: Callable[[int], None] | None) -> torch.Tensor:
        bs, dev, nd = self.config.block_size, self.device, inputs.num_decodes
        tables = inputs.decode_tables
        max_blocks = max((len(t) for t in tables), default=1)
        decode_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables],
                                     dtype=torch.long).view(nd, max_blocks)
        seq_lens = torch.tensor([p + 1 for p in inputs.positions[:nd]], dtype=torch.long)
        decode_mask = (build_decode_mask(seq_lens, max_blocks * bs, self.dtype, dev)
                       if self.backend.needs_decode_mask else None)  # the kernels read seq_lens instead
        slots = inputs.decode_slots(bs)
        chunks = []
        for c in inputs.chunks:
            key_slots = c.key_slots(bs)  # [ctx_len + q_len]: the context, then the new tokens
            chunks.append(ChunkSpec(c.q_start, c.q_len, c.ctx_len, key_slots))
            slots.extend(key_slots[c.ctx_len:].tolist())
        meta = AttentionMetadata(
            slot_mapping=upload(slots, dev, torch.long),
            num_decodes=nd,
            decode_block_tables=upload(decode_tables, dev),
            decode_seq_lens=upload(seq_lens, dev),
            decode_mask=decode_mask,
            prefills=build_prefill_groups(chunks, dev, self.prefill_varlen),
        )
        input_ids = upload(inputs.input_ids, dev, torch.long)
        if inputs.from_last:
            assert self._last_tokens is not None, "rows read from the last launch's tokens"
            pairs = [(d, s) for d, s in enumerate(inputs.from_last) if s >= 0]
            dst_rows, src_rows = [d for d, _ in pairs], [s for _, s in pairs]
            input_ids.index_copy_(0, upload(dst_rows, dev), self._last_tokens[upload(src_rows, dev)])
        return self.model(input_ids, upload(inputs.positions, dev, torch.long), self.kv_caches, meta, self.backend,
                          upload(inputs.logits_rows, dev, torch.long), before_layer)


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
