"""EngineThread: runs an EngineCore on its own thread so that network I/O never
stalls a step and a long forward pass never stalls the sockets.

The boundary is strict. Only the engine thread touches the engine; the event loop
owns requests, transfers and sockets. They exchange typed messages, and nothing
else crosses:

    event loop                                       engine thread
    ----------                                       -------------
    await et.submit(Command)        --queue-->       handled between steps, in order;
                                    <--result--      its return value (or exception)
    on_deltas([RequestDelta])       <--------------  after each step
    on_kv_events(events, None)      <--------------  prefix-cache events, after each pass
    request_kv_snapshot() --flag--> on_kv_events([], every held hash -> tier)
    exporter.on_blocks(BlocksReady) <--------------  prompt blocks packed for an ExportKV
    et.stats (EngineStats)          <--publishes---  a fresh immutable snapshot per pass
                                                     step_observer(SchedulerOutput, started, deltas, live)
                                                     runs ON the engine thread (step metrics)

Commands (``submit`` answers with what the engine call returns). The five that carry a prompt
carry its ``PromptRef`` (common/prompt_ref.py: ids, hash keys, block hashes; frozen
dataclasses, the rest by keyword); the others are NamedTuples:

    AddRequest(id, prompt, params=, grammar=) -> None  schedule a prompt (prefill + decode here)
        (AddRequest and AddPrefilled carry a structured output's compiled grammar: the
        engine thread never compiles one, node/grammar_service.py does, in its workers)
    Reserve(id, prompt)                    -> Reservation | None (no free blocks)
    AddPrefilled(id, prompt, params=, first_token=, logprobs=, num_cached_tokens=[, prompt_logprobs=])
                                           -> RequestDelta     (also handed to on_deltas, in order)
    Release(id)                            -> None     give back a reservation never admitted
    AbortRequest(id, reason)               -> bool     finish it, free its blocks *and* any
                                                       reservation, stop its export; idempotent
    ExportCached(id, prefix, start_block=, max_blocks=, pack=)
                                           -> Exported copy out up to ``max_blocks`` cached
                                                       blocks of a prefix from ``start_block``
                                                       (a prefix pull's chunk), timed
    CommitPulled(id, prefix, num_tokens=)  -> None     a pull landed: cache its blocks, free
                                                       the reservation
    ExportKV(id, transfer, addrs, skip, dest_ids) -> None   pack the request's prompt blocks
                                                       [skip, ...) for those receivers: its cached
                                                       prefix before its first forward, then what
                                                       each step completes -> BlocksReady events
                                                       (send it before the AddRequest; it ends
                                                       with the request; engine/block_export.py)
    ResetPrefixCache()                     -> bool
    CachedHashes()                         -> list[int]

A rank of a tensor-parallel engine that dies or hangs (``TPFailure`` from a step) is
fatal, not one step's error: the running requests end with "error", every command
then waiting or sent later fails with that ``TPFailure``, the thread stops, and
``on_fatal(error)`` runs on the event loop (the node exits; its supervisor restarts it).
Any other exception from a step is that step's error: the engine's requests end with
"error" and the thread goes on. On a data-parallel rank the step fails on every rank of the
node: the failing rank completes its forward's collectives with no tokens (so its peers'
forward completes), and at the next turn's agreement every rank ends the requests it holds
with "error" and none steps (ranks/data_parallel.py); a rank that cannot complete the
forward stops as if a rank died.

A command runs even when its awaiting coroutine was cancelled meanwhile, so a
request's owner ends it with ``AbortRequest`` (queued after anything it sent
before): that frees whatever the earlier commands took. Events reach the event loop in
engine order, so a request's ``BlocksReady`` events come before the delta that
finishes it, and a snapshot replaces every event batch handed over before it.
Callbacks run on the event loop; the engine thread never reads or writes loop
state. The EngineThread is the only holder of the engine once built: the event loop
gets the engine's fixed facts (RequestLimits, the KV tensor the transfers use)
before ``start()``, and everything else through the messages above
(tests/test_thread_boundary.py pins this). Owns no sockets.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import KW_ONLY, dataclass
from typing import Any, Callable, NamedTuple

from ..common.kv_tier_stats import TierStats
from ..common.kv_events import KVEvent, Tier
from ..common.sampling_params import PromptLogprob, SamplingParams, TokenLogprobs
from ..common.load import NodeLoad
from ..common.prompt_ref import PromptRef
from .block_export import BlockExporter, BlockExports, ExportKV
from .copy_timer import CopyTime, CopyTimer
from .engine_core import EngineCore, RequestDelta
from .ranks.data_parallel import IDLE_POLL_S
from .parallel.group import TPFailure
from .scheduler import SchedulerOutput

log = logging.getLogger(__name__)

# (events since the last call, or [] with a snapshot; every cached hash, or None)
KVEventsCallback = Callable[[list[KVEvent], "dict[int, Tier] | None"], None]
# engine thread, after each step: (what it scheduled, when that step began (time.monotonic()),
# what it produced, unfinished requests left)
StepObserver = Callable[[SchedulerOutput, float, list[RequestDelta], int], None]


def _carried(params: SamplingParams, grammar: Any) -> None:
    assert params.structured_outputs is None or grammar is not None, \
        "a structured request reaches the engine thread with its compiled grammar: it never compiles"


# ---- commands (event loop -> engine thread) ----------------------------------------------
@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt: PromptRef
    _: KW_ONLY
    params: SamplingParams
    grammar: Any = None  # params.structured_outputs compiled (xgrammar.CompiledGrammar); required with one


@dataclass(frozen=True, slots=True)
class Reserve:
    request_id: str
    prompt: PromptRef


@dataclass(frozen=True, slots=True)
class AddPrefilled:
    request_id: str
    prompt: PromptRef  # the one its Reserve held blocks for
    _: KW_ONLY
    params: SamplingParams
    first_token: int
    logprobs: TokenLogprobs | None
    num_cached_tokens: int
    prompt_logprobs: list[PromptLogprob | None] | None = None  # computed by the prefill node
    grammar: Any = None  # as AddRequest's


class Release(NamedTuple):
    request_id: str


@dataclass(frozen=True, slots=True)
class ExportCached:
    """Copy out cached blocks of a prefix for another node (``EngineCore.export_cached``):
    answers ``Exported``. ``pack`` runs here, on the engine thread, between two steps."""
    export_id: str
    prompt: PromptRef
    _: KW_ONLY
    start_block: int
    max_blocks: int
    pack: Callable[[list[int]], Any]


class Exported(NamedTuple):
    """What an ``ExportCached`` copied out, and what that cost the engine (all of it: lookup,
    lower-tier reads and loads, the copy; engine/copy_timer.py)."""
    blocks: int
    packed: Any  # ``pack``'s result; None for no block
    copy: CopyTime


@dataclass(frozen=True, slots=True)
class CommitPulled:
    """A reservation's first ``num_tokens`` hold a pulled prefix: cache them and give the
    reservation back (``EngineCore.commit_pulled``)."""
    request_id: str
    prompt: PromptRef  # the prefix its Reserve held blocks for
    _: KW_ONLY
    num_tokens: int


class AbortRequest(NamedTuple):
    request_id: str
    reason: str = "abort"


class ResetPrefixCache(NamedTuple):
    pass


class CachedHashes(NamedTuple):
    pass


Command = (AddRequest | Reserve | AddPrefilled | Release | ExportCached | CommitPulled | AbortRequest | ExportKV
           | ResetPrefixCache | CachedHashes)


# ---- events (engine thread -> event loop) ------------------------------------------------
class EngineStats(NamedTuple):
    """What the event loop may know about the engine, published after every pass."""
    load: NodeLoad
    steps: int
    kv_blocks_total: int
    kv_blocks_free: int
    busy_s: float
    computed_tokens: int
    preemptions: int
    sim_overrun_s: float = 0.0  # a simulated node's wall seconds beyond its steps' time (sim_runner.py)
    tiers: tuple[TierStats, ...] = ()  # each tier of the prefix cache, device first (EngineCore.tier_stats)
    # (MoE layer, max / mean tokens per expert) of a forward at most EXPERT_LOAD_EVERY_S old; () when dense
    expert_load: tuple[tuple[int, float], ...] = ()


# Seconds between reads of a MoE model's expert counts: each read copies from the device and waits
# for the step queued behind it (one lost overlap a second)
EXPERT_LOAD_EVERY_S = 1.0


class EngineThread:
    def __init__(self, engine: EngineCore, aio_loop: asyncio.AbstractEventLoop,
                 on_deltas: Callable[[list[RequestDelta]], None],
                 on_kv_events: KVEventsCallback | None = None, exporter: BlockExporter | None = None,
                 step_observer: StepObserver | None = None,
                 on_fatal: Callable[[TPFailure], None] | None = None):
        self._engine = engine  # the engine thread's from start() on; nobody else holds it
        self._aio = aio_loop
        self._on_deltas = on_deltas
        self._on_kv_events = on_kv_events  # None: events are drained and dropped
        # engine thread: the exports of an exporting node (None: it exports nothing)
        self._exports = None if exporter is None else BlockExports(exporter, engine.kv, engine.config.block_size,
                                                                   aio_loop)
        self._snapshot_wanted = False
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # (Command, future) | None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._steps = 0
        self._expert_load: tuple[tuple[int, float], ...] = ()
        self._expert_load_at = -EXPERT_LOAD_EVERY_S  # monotonic time of the last read
        self.stats = self._stats()  # replaced (never mutated) by the engine thread; read anywhere
        self._step_observer = step_observer
        self._scheduled: SchedulerOutput | None = None  # engine thread: the step being computed
        self._on_fatal = on_fatal
        self.fatal: TPFailure | None = None  # set once by the engine thread: it stopped for good
        self._fatal_lock = threading.Lock()
        if self._exports is not None:  # only an exporting node packs a cached prefix ahead of the forward
            engine.on_kv_in_place = self._exports.pack
        engine.on_launch = self._on_launch

    @property
    def load(self) -> NodeLoad:
        return self.stats.load

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the thread after its current step; whether it ended within ``timeout_s``
        (a step may hang on a collective up to its timeout). A data-parallel rank's thread
        stops at the first turn every rank is stopping, joining its peers' forwards until then
        (none is left waiting in a collective): give it its peers' drain."""
        self._stop.set()
        self._commands.put(None)
        if self._thread.ident is not None:
            self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def close_engine(self) -> None:
        """``EngineCore.close`` once the thread ended (``stop`` returned True): a
        tensor-parallel engine sends its workers Stop. No-op while the thread runs."""
        if not self._thread.is_alive():
            self._engine.close()

    def submit(self, command: Command) -> asyncio.Future:
        """Queue ``command`` for the engine thread now (commands run in submission order);
        await the future for its result or exception."""
        fut = self._aio.create_future()
        with self._fatal_lock:  # a command is queued before the thread dies, or fails here
            if self.fatal is not None:
                fut.set_exception(self.fatal)
                return fut
            self._commands.put((command, fut))
        return fut

    def request_kv_snapshot(self) -> None:
        """Ask for ``on_kv_events([], held)`` with every hash held now (hash -> the fastest
        tier holding it), after the event batches already drained (from any thread; at
        most one per request)."""
        self._snapshot_wanted = True
        self._commands.put(None)  # wakes an idle engine thread

    # ---- engine thread ---------------------------------------------------------------------
    def _stats(self) -> EngineStats:
        e = self._engine
        now = time.monotonic()
        if self._steps and now - self._expert_load_at >= EXPERT_LOAD_EVERY_S:  # the first after the first step
            self._expert_load, self._expert_load_at = tuple(e.runner.expert_load().items()), now
        return EngineStats(e.load(), self._steps, e.kv.num_blocks, e.kv.num_free_blocks, e.busy_s,
                           e.num_computed_tokens_total, e.num_preemptions_total,
                           e.runner.overrun_s, tuple(e.tier_stats()), self._expert_load)

    def _handle(self, cmd: Command) -> Any:
        e = self._engine
        match cmd:
            case AddRequest():
                _carried(cmd.params, cmd.grammar)
                return e.add_request(cmd.request_id, cmd.prompt, cmd.params, grammar=cmd.grammar)
            case Reserve():
                return e.reserve(cmd.request_id, cmd.prompt)
            case AddPrefilled():
                _carried(cmd.params, cmd.grammar)
                delta = e.add_prefilled(cmd.request_id, cmd.prompt, cmd.params, first_token=cmd.first_token,
                                        logprobs=cmd.logprobs, num_cached_tokens=cmd.num_cached_tokens,
                                        prompt_logprobs=cmd.prompt_logprobs, grammar=cmd.grammar)
                # through on_deltas, queued before any step's deltas: the first token reaches the
                # request's stream before the second (the awaiter of the result runs later)
                self._aio.call_soon_threadsafe(self._on_deltas, [delta])
                return delta
            case Release(rid):
                return e.release(rid)
            case ExportCached():
                timer = CopyTimer(e.runner.kv_caches.device)
                blocks, packed = e.export_cached(cmd.export_id, cmd.prompt, start_block=cmd.start_block,
                                                 max_blocks=cmd.max_blocks, pack=cmd.pack)
                return Exported(blocks, packed, timer.stop())
            case CommitPulled():
                return e.commit_pulled(cmd.request_id, cmd.prompt, num_tokens=cmd.num_tokens)
            case AbortRequest(rid, reason):
                if self._exports is not None:
                    self._exports.end(rid)
                found = e.abort(rid, reason)
                held = rid in e.kv
                e.release(rid)  # a reservation never admitted (no-op once aborted above)
                return found or held
            case ExportKV():
                assert self._exports is not None, "ExportKV needs an EngineThread built with an exporter"
                self._exports.start(cmd)
                return None
            case ResetPrefixCache():
                return e.kv.reset_prefix_cache()
            case CachedHashes():
                return list(e.kv.cached_hashes())
        raise TypeError(f"not an engine command: {cmd!r}")

    def _on_launch(self, sched: SchedulerOutput) -> None:
        self._scheduled = sched
        if self._exports is not None:
            self._exports.pack(sched)

    def _die(self, error: TPFailure) -> None:
        """Fail every request and every command, now and later, with ``error``; stop."""
        log.error("engine stopped: %s", error)
        with self._fatal_lock:
            self.fatal = error
        deltas = [RequestDelta(rid, [], [], "error", 0) for rid in list(self._engine.scheduler.requests)]
        for d in deltas:
            self._engine.scheduler.finish(d.request_id, "error")
        self.stats = self._stats()
        if deltas:
            self._aio.call_soon_threadsafe(self._on_deltas, deltas)
        while True:  # commands queued before `fatal` was set
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._aio.call_soon_threadsafe(self._resolve, item[1], None, error)
        if self._on_fatal is not None:
            self._aio.call_soon_threadsafe(self._on_fatal, error)

    def _drain_kv_events(self) -> None:
        events = self._engine.kv.take_events()
        if self._on_kv_events is None:
            return
        if self._snapshot_wanted:
            self._snapshot_wanted = False  # the drained events are part of the snapshot
            self._aio.call_soon_threadsafe(self._on_kv_events, [], self._engine.kv.held_blocks())
        elif events:
            self._aio.call_soon_threadsafe(self._on_kv_events, events, None)

    @staticmethod
    def _resolve(fut: asyncio.Future, result, exc) -> None:
        if fut.cancelled():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _run_command(self, item) -> None:
        cmd, fut = item
        try:
            result, exc = self._handle(cmd), None
        except Exception as e:  # handed to the awaiting coroutine, which decides
            result, exc = None, e
        self.stats = self._stats()  # an awaiter of AbortRequest sees the blocks it freed
        self._aio.call_soon_threadsafe(self._resolve, fut, result, exc)

    def _fail_all(self) -> list[RequestDelta]:
        """End every request the engine holds with an "error" outcome (their blocks freed)."""
        deltas = [RequestDelta(rid, [], [], "error", 0) for rid in list(self._engine.scheduler.requests)]
        for d in deltas:
            self._engine.abort(d.request_id, "error")
        return deltas

    def _run(self) -> None:
        dp = self._engine.dp  # a data-parallel rank: every turn agrees with its peers whether anyone steps
        failed = False  # a data-parallel rank: its last step raised (its peers learn it at the next agreement)
        while dp is not None or not self._stop.is_set():  # a DP rank stops when all agree (below)
            idle = not self._engine.has_unfinished()
            try:  # block only when there is nothing to compute (a DP rank polls: a peer may need it)
                item = (self._commands.get(timeout=IDLE_POLL_S if dp is not None else 0.5) if idle
                        else self._commands.get_nowait())
            except queue.Empty:
                item = None
            while item is not None:
                self._run_command(item)
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    item = None
            if dp is None and self._stop.is_set():
                break
            deltas = []
            busy = self._engine.has_unfinished()
            steps = busy
            if dp is not None:
                try:
                    turn = dp.agree(busy, failed, leaving=self._stop.is_set())
                except TPFailure as e:  # a data-parallel peer is gone
                    self._die(e)
                    return
                if turn.leave:  # every rank stops at this turn: no collective follows
                    break
                failed, steps = False, turn.step
                if turn.failed:  # the node's step failed on some rank: it fails on every rank
                    deltas = self._fail_all()
                    log.error("a data-parallel rank's step failed; failing %d requests", len(deltas))
            if steps:
                started = time.monotonic()  # the step observed below is scheduled from here
                try:
                    deltas = self._engine.step()
                except TPFailure as e:  # a rank is gone: this engine cannot step again
                    self._die(e)
                    return
                except Exception as e:  # a bug must not hang every client: fail what was running
                    if dp is None:
                        log.exception("engine step failed; failing %d requests", len(self._engine.scheduler.requests))
                        deltas = self._fail_all()
                    else:  # the peers' forward completes; the next agreement fails every rank's requests
                        log.exception("engine step failed on data-parallel rank %d", dp.rank)
                        try:
                            self._engine.complete_failed_step()
                        except Exception as again:
                            self._die(again if isinstance(again, TPFailure) else TPFailure(
                                f"data-parallel rank {dp.rank}: its failed step ({e!r}) could not be completed "
                                f"({again!r}); the node must restart"))
                            return
                        failed = True
                self._steps += 1
                if self._step_observer is not None and self._scheduled is not None:
                    self._step_observer(self._scheduled, started, deltas,
                                        len(self._engine.scheduler.requests))
                self._scheduled = None
            for d in deltas:  # finished requests export nothing more
                if d.finish_reason is not None and self._exports is not None:
                    self._exports.end(d.request_id)
            self.stats = self._stats()  # before the deltas: a client that saw its end sees its blocks free
            if deltas:
                self._aio.call_soon_threadsafe(self._on_deltas, deltas)
            self._drain_kv_events()
