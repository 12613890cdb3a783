"""EngineCore: the step loop (schedule -> forward -> sample -> stop checks) over
one model. Single-threaded; servers run it on their own thread so network I/O
never stalls a step.

Async scheduling (``EngineConfig.async_scheduling``, on for GPUs): the host
schedules and launches step N+1 before it waits for step N's tokens, so the device
never idles while the host does stop checks, bookkeeping and scheduling:

    step() call k:   schedule N+1 | launch N+1 | wait for N, stop checks | -> deltas of N
    device:          ...... N ......|........ N+1 ........

A token step N samples is pending (``Request.pending_tokens``) until it lands; step
N+1 decodes its position with the id read on the device. What that costs: a request
that stops on a sampled token (EOS, a stop id) computes one more token, which is
dropped; a length stop is foreseen and costs nothing. A request whose sampling reads
its earlier tokens on the host (grammar, penalties, min_tokens) cannot be sampled
with one pending, so when the step in flight sampled for such a request, that step
lands before the next is scheduled; so does a step that verified proposed tokens (how
many it keeps decides where the next step starts: scheduler.py ``Row``). Without async
scheduling every step lands before ``step()`` returns (on the CPU the forward runs inside
``launch`` anyway, so there is nothing to overlap and the deltas would only come one step
later).

Token-level stops (EOS, stop_token_ids, max_tokens, context length) are decided
here; stop *strings* need text, so the caller that detokenizes finishes those
requests through ``abort(req_id, "stop")``.

Tensor parallelism (``tensor_parallel_size`` > 1): this engine is rank 0. It schedules,
owns the block ids, prefix cache and hashes, samples, and its ModelRunner sends every
step to the worker ranks (ranks/launch.py, ranks/worker.py). Given no ``tp`` leader, it starts
the workers itself as child processes (offline use: ``LLM(..., tensor_parallel_size=2)``);
a node passes the ``TPLeader`` whose rendezvous it gave the ranks it started. A rank
that dies or hangs makes ``step()`` raise ``TPFailure``; ``close()`` stops the workers.
Building the runner and the ranks beside it is ranks/bringup.py's.
"""

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, TypeVar

import torch

from ..common.config import EngineConfig
from ..common.errors import InvalidRequest
from ..common.kv_tier_stats import TierStats
from ..common.load import NodeLoad
from ..common.prompt_ref import PromptKeys, PromptRef
from ..common.sampling_params import PromptLogprob, SamplingParams, TokenLogprobs
from .kv.cache_manager import ComputedBlocks, KVCacheManager
from .kv.tier_spec import TierObserver
from .limits import RequestLimits
from .models.loader import resolve_model_dir
from .model_runner import KVCacheFactory, ModelRunner
from .parallel.group import TPFailure
from .ranks.bringup import Ranks, start_runner
from .request import Request
from .runner import LaunchedStep, Runner, prompt_tokens
from .sampling.sampler import Sampler
from .scheduler import Scheduler, SchedulerOutput
from .sampling.structured import GrammarCache

if TYPE_CHECKING:
    from .parallel.group import DataParallel
    from .ranks.launch import TPLeader

T = TypeVar("T")
log = logging.getLogger(__name__)


class RequestDelta(NamedTuple):
    """What one step produced for one request."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: str | None  # None while running
    num_cached_tokens: int
    # on the delta of the first token of a request that asked (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[PromptLogprob | None] | None = None


class Reservation(NamedTuple):
    """Blocks a decode node holds for a prompt whose KV another node computes."""
    block_ids: list[int]  # one per prompt block, in order (the last may be partial)
    num_cached_tokens: int  # leading tokens already in this engine's prefix cache


class EngineCore:
    def __init__(self, config: EngineConfig, kv_cache_factory: KVCacheFactory | None = None,
                 tp: "TPLeader | None" = None, tier_observer: TierObserver | None = None):
        """``tp``: rank 0's leader of a node whose workers it started (see ranks/launch.py); None
        with ``tensor_parallel_size`` > 1 starts them here, as child processes. ``tier_observer``:
        what counts the lower tiers' moves, hits and faults (a node's metrics), if any."""
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        # ModelRunner (over rank 0's shard, with the workers joined), or SimRunner (ranks/bringup.py)
        self.runner: Runner
        self.runner, self._ranks = start_runner(config, self.model_dir, kv_cache_factory, tp)
        self.tp: TPLeader | None = self._ranks.tp
        self.dp: DataParallel | None = self._ranks.dp  # this engine is a data-parallel rank (ranks/data_parallel.py)
        self.model_config = self.runner.model_config
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.num_blocks = self.runner.num_blocks
        # structured outputs (None on a simulated node, which samples no real tokens): matchers, and
        # the offline LLM's compiles (a node compiles in its workers and carries the grammar)
        self.grammars = None if config.sim is not None else GrammarCache(
            self.model_dir, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self.limits = RequestLimits(self.model_config.vocab_size, self.max_model_len, self.kv_capacity_tokens,
                                    self.grammars is not None)
        # with the lower tiers of the prefix cache (host memory, disk), if configured (kv/tier_store.py)
        self.kv = KVCacheManager.build(config, self.num_blocks, self.runner.kv_caches, tier_observer)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.prefill_chunk_size, self.max_model_len,
                                   prefill_step_budget=config.prefill_step_budget)
        self._in_flight: LaunchedStep | None = None  # async scheduling: launched, not landed
        self.num_computed_tokens_total = 0  # tokens that went through the model (a metric)
        self.busy_s = 0.0  # wall seconds spent in forward passes (a metric)
        # Called on every step just before its forward is issued, with what it queues placed
        # behind the blocks the step reads (its lower-tier loads: beside the forward): the
        # EngineThread packs the blocks a request had complete before the step (its cached
        # prefix) here, so they leave while the step computes.
        self.on_kv_in_place: Callable[[SchedulerOutput], None] | None = None
        # Called on every step once it is launched (the computed counts advanced) and before
        # finished requests free their blocks: the EngineThread packs completed blocks here.
        self.on_launch: Callable[[SchedulerOutput], None] | None = None
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB)", self.num_blocks,
                 config.block_size, self.kv_capacity_tokens, config.kv_cache_memory / 2**20)

    def close(self) -> None:
        """Stop the worker ranks, if any, and give this process back the cores it had before
        rank 0 was pinned to its share (idempotent); the disk tier's writer finishes its
        queue. Call from the thread that steps."""
        kv: KVCacheManager | None = getattr(self, "kv", None)  # absent if the runner failed to build
        if kv is not None:
            kv.close()
        ranks: Ranks | None = getattr(self, "_ranks", None)
        if ranks is not None:
            ranks.close()

    def tier_stats(self) -> list[TierStats]:
        """Each tier of the prefix cache, device first. The device tier's load rate is the
        recompute rate (prefill tokens/s in bytes of blocks), measured with lower tiers only."""
        kv = self.runner.kv_caches  # rank 0's heads of every block: each rank holds as many, about
        return self.kv.tier_stats(kv[:, :, 0].numel() * kv.element_size() * self.config.tensor_parallel_size)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    @property
    def num_preemptions_total(self) -> int:
        return self.scheduler.num_preemptions

    def prompt_ref(self, token_ids: list[int], **keys) -> PromptRef:
        """``token_ids`` as this engine's ``PromptRef``: its model id the model key, ``keys`` the
        other fields of ``PromptKeys`` (``cache_salt``, ...). The offline LLM's one place (and
        tests'); a node builds its requests' from the wire (node/prompt_hashes.py)."""
        return PromptRef(token_ids, PromptKeys(model=self.config.model_id, **keys), self.config.block_size)

    def _hashes(self, prompt: PromptRef) -> list[int]:
        """``prompt``'s block hashes as the block pool takes them (computed now unless known)."""
        assert prompt.block_size == self.config.block_size, (prompt.block_size, self.config.block_size)
        return prompt.block_hashes().tolist()

    def _new_request(self, request_id: str, prompt: PromptRef, params: SamplingParams,
                     grammar: Any = None) -> Request:
        assert prompt.block_size == self.config.block_size, (prompt.block_size, self.config.block_size)
        self.limits.check(prompt.token_ids, params)
        if request_id in self.scheduler.requests:
            raise InvalidRequest("request_id", f"{request_id!r} is already running")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.model_config.eos_token_ids)
        gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        state = None
        if params.structured_outputs is not None:
            assert self.grammars is not None, "limits.check refuses structured outputs on a simulated engine"
            state = self.grammars.new_state(params.structured_outputs, grammar)
        return Request(request_id, prompt, params, frozenset(stop_ids), gen, state)

    def add_request(self, request_id: str, prompt: PromptRef, params: SamplingParams, *,
                    grammar: Any = None) -> None:
        """Schedule a prompt. Every block of the request (decoded ones too) is hashed with
        ``prompt``'s keys, so the prefix cache shares blocks only between requests of the same
        keys (model, cache salt, ...); its hashes are computed here unless it carries them.
        ``grammar``: the structured output's compiled grammar when the caller carries it
        (a node always does); None compiles it here (the offline LLM)."""
        if request_id in self.kv:
            raise InvalidRequest("request_id", f"{request_id!r} holds a KV reservation")
        self.scheduler.add(self._new_request(request_id, prompt, params, grammar))

    def reserve(self, request_id: str, prompt: PromptRef) -> Reservation | None:
        """Hold blocks for the whole prompt, reusing this engine's cached prefix of the same
        keys: its device hits, and of the run after them in a lower tier what one
        step may load (``Scheduler.load_allowance``, priced as the scheduler prices a run; the
        next step waits for these loads whole, so beside running decodes, none); the sender
        fills the rest. None when the block pool cannot supply them now (the caller prefills
        locally). Raising (a lower tier failing to load), it holds nothing."""
        if request_id in self.scheduler.requests or request_id in self.kv:
            raise InvalidRequest("request_id", f"{request_id!r} is already running")
        ids = prompt.token_ids
        hit = self.kv.get_computed_blocks(self._hashes(prompt), ids, prompt.salt)
        lower = hit.lower[:self.kv.lower_plan(hit.lower, self.scheduler.load_allowance(whole=True)).blocks]
        if self.kv.allocate_slots(request_id, len(ids), hit.blocks, lower) is None:
            return None
        try:
            self.kv.before_write()  # a receiver may write the blocks next: their loads and stores land first
        except BaseException:
            self.kv.free(request_id)  # a reservation that raises holds nothing
            raise
        return Reservation(self.kv.block_ids(request_id), self.kv.num_cached_tokens(request_id))

    def export_cached(self, export_id: str, prompt: PromptRef, *, start_block: int, max_blocks: int,
                      pack: Callable[[list[int]], T]) -> tuple[int, T | None]:
        """Blocks ``start_block ..`` of the prefix ``prompt`` (whole blocks) that this engine
        caches, at most ``max_blocks`` of the leading run: (how many, ``pack`` of their block
        ids), (0, None) for none. Blocks in a lower tier are loaded first (when the pool has
        room for them; else only the device's run counts). The blocks are held only while
        ``pack`` runs (it copies them out), so the running batch keeps its pool."""
        bs = self.config.block_size
        end = (start_block + max_blocks) * bs
        hit = self.kv.get_computed_blocks(self._hashes(prompt), prompt.token_ids[:end], prompt.salt, whole=True)
        if self.kv.allocate_slots(export_id, hit.num_tokens, hit.blocks, hit.lower) is None:
            hit = ComputedBlocks(hit.blocks, len(hit.blocks) * bs)
            self.kv.allocate_slots(export_id, hit.num_tokens, hit.blocks)  # pinning cached blocks never fails
        try:
            self.kv.before_write()  # the lower-tier loads land before the copy reads them
            # the cached run (a disk file that failed its read as it loaded ends it)
            ids = self.kv.block_ids(export_id)[start_block:self.kv.num_cached_tokens(export_id) // bs] \
                if export_id in self.kv else []
            return (len(ids), pack(ids)) if ids else (0, None)
        finally:
            self.kv.free(export_id)

    def commit_pulled(self, request_id: str, prompt: PromptRef, *, num_tokens: int) -> None:
        """The reservation ``request_id`` (a `reserve` of the prefix ``prompt``) now holds
        another node's KV of its first ``num_tokens`` (whole blocks): register them in the
        prefix cache, then give the reservation back, so the request that follows finds them
        as a hit."""
        if request_id in self.kv and num_tokens:
            self.kv.cache_blocks(request_id, self._hashes(prompt), prompt.token_ids, num_tokens, prompt.salt)
        self.kv.free(request_id)

    def release(self, request_id: str) -> None:
        """Give back a reservation that will not be admitted (failed transfer). Idempotent."""
        if request_id not in self.scheduler.requests:
            self.kv.free(request_id)

    def add_prefilled(self, request_id: str, prompt: PromptRef, params: SamplingParams, *, first_token: int,
                      logprobs: TokenLogprobs | None, num_cached_tokens: int,
                      prompt_logprobs: list[PromptLogprob | None] | None = None,
                      grammar: Any = None) -> RequestDelta:
        """Admit a request whose prompt KV landed in its reserved blocks and whose
        first token was sampled elsewhere; it joins the running batch to decode.
        ``prompt``: the one its ``reserve`` held blocks for; ``grammar``: as `add_request`."""
        req = self._new_request(request_id, prompt, params, grammar)
        req.num_computed_tokens = len(prompt)
        req.num_cached_tokens = num_cached_tokens
        Sampler.skip_step(req, self.model_config.vocab_size)  # the prefill node drew the first token
        self.kv.cache_blocks(request_id, req.block_hashes, req.all_token_ids, req.num_computed_tokens, req.salt)
        req.append_tokens([first_token], [logprobs])  # advances its grammar past the first token
        self.scheduler.add_running(req)
        reason = req.check_stop(self.max_model_len)
        if reason is not None:
            self.scheduler.finish(request_id, reason)
        return RequestDelta(request_id, [first_token], [logprobs], reason, num_cached_tokens,
                            prompt_logprobs)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Finish a request now and free its blocks; idempotent."""
        return self.scheduler.finish(request_id, reason) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def load(self) -> NodeLoad:
        sched = self.scheduler
        queued = sum(max(0, len(r.prompt_token_ids) - r.num_computed_tokens)
                     for r in (*sched.running, *sched.waiting))
        return NodeLoad(running=len(sched.running), waiting=len(sched.waiting), queued_prefill_tokens=queued,
                        kv_usage=self.kv.usage, kv_free_blocks=self.kv.num_free_blocks,
                        generated_tokens=sum(len(r.output_token_ids) for r in sched.running))

    def step(self) -> list[RequestDelta]:
        """Run one step and return what landed: this step's deltas, or with async
        scheduling the previous step's (the one launched now lands on the next call)."""
        prev, self._in_flight = self._in_flight, None
        deltas: list[RequestDelta] = []
        if prev is not None and any(r.request.samples_from_history or r.num_proposed for r in prev.rows):
            deltas, prev = self._land(prev), None
        out = self.scheduler.schedule()
        # a step of lower-tier loads alone (a prompt loading a long run, nothing else to run) launches too
        launched = self._launch(out) if out.rows or self.kv.loads_queued else None
        if not out.rows and self.dp is not None:  # a peer steps: join its MoE layers with no tokens
            assert isinstance(self.runner, ModelRunner)
            self.runner.idle_forward()
        if prev is not None:
            deltas = self._land(prev)
        if launched is not None:
            if self.config.async_scheduling:
                self._in_flight = launched
            else:
                deltas += self._land(launched)
        return deltas

    def complete_failed_step(self) -> None:
        """A data-parallel rank whose ``step()`` raised (not a ``TPFailure``): issue what is left of
        the step's forward, with no tokens, so its peers' forward completes (ranks/data_parallel.py)."""
        assert self.dp is not None and isinstance(self.runner, ModelRunner), "a data-parallel rank's engine"
        self.dp.complete_forward(self.runner.idle_forward)

    def _launch(self, out: SchedulerOutput) -> LaunchedStep:
        loads = self.kv.loads_queued
        t0 = time.perf_counter()
        try:
            in_place = None if self.on_kv_in_place is None else partial(self.on_kv_in_place, out)
            launched = self.runner.launch(out, self.kv, in_place)
        except TPFailure as e:
            assert self.tp is not None or self.dp is not None, "only a TP or DP engine's runner raises TPFailure"
            if self.tp is None:
                raise  # a data-parallel peer: the collective's own words name the rank
            raise self.tp.explain(e) from e
        elapsed = time.perf_counter() - t0
        self.busy_s += elapsed
        # the forward ran in launch, beside no load; a simulated node's runner reports its own
        if not self.config.async_scheduling and not loads and self.config.sim is None:
            prompt = prompt_tokens(out)
            if prompt >= self.config.block_size:  # the recompute rate a lower-tier load competes with
                self.kv.observe_prefill(prompt, elapsed)
            elif not prompt and out.rows:  # the running batch alone: the loads a step hides
                self.kv.observe_batch(elapsed)
        for row in launched.rows:
            row.request.pending_tokens += row.num_verify
        self.scheduler.update_after_step(out)
        self.kv.save_cached()  # blocks completed by this forward or landed since: to the host behind it
        self.num_computed_tokens_total += launched.num_tokens
        if self.on_launch is not None:
            self.on_launch(out)
        return launched

    def _land(self, launched: LaunchedStep) -> list[RequestDelta]:
        """Wait for a launched step's tokens, append them and check stops."""
        t0 = time.perf_counter()
        result = launched.result()
        self.busy_s += time.perf_counter() - t0
        for req, start, values in result.prompt_logprobs:
            req.record_prompt_logprobs(start, values)
        deltas = []
        for row, tokens, logprobs in result.sampled:
            req = row.request
            req.pending_tokens -= row.num_verify
            if self.scheduler.requests.get(req.request_id) is not req:
                continue  # finished (a stop sampled one step earlier) or aborted while on the device
            # it keeps the token sampled after its own last one; of its drafts, none yet (keeping
            # none is always right, only slower), and rolls them back
            req.rollback(row.num_proposed)
            tokens, logprobs = tokens[:1], logprobs[:1]
            req.append_tokens(tokens, logprobs)
            self.scheduler.cache_computed(req)
            reason = req.check_stop(self.max_model_len)
            if reason is not None:
                self.scheduler.finish(req.request_id, reason)
            first = len(req.output_token_ids) == len(tokens) and req.sampling_params.prompt_logprobs is not None
            deltas.append(RequestDelta(req.request_id, tokens, logprobs, reason, req.num_cached_tokens,
                                       req.prompt_logprobs if first else None))
        return deltas
