"""GrammarService: a node's compiled structured-output grammars, compiled in worker
processes under a CPU-time limit, and carried to the engine with each request.

    request handler (event loop)          GrammarService
    await grammar(params, may_compile) -> compiled before?    -> that CompiledGrammar (LRU,
                                                                 MAX_CACHED_GRAMMARS and
                                                                 MAX_CACHED_BYTES)
                                          refused before?     -> the same 400 (LRU of refusals)
                                          compiling already?  -> waits for that compile
                                          not ``may_compile`` -> `GrammarNotCompiled` (a 409:
                                          the router's compile budget did not pay for one)
                                          else a worker slot (``workers`` of them; at most
                                          MAX_WAITING_PER_WORKER compiles wait per slot,
                                          beyond: `CompileUnavailable`, a 503 + Retry-After)
                                            -> CompileWorker.compile on a thread
                                               (engine/sampling/grammar_worker.py: a process, niced,
                                               killed past ``timeout_s`` CPU seconds)
                                            -> compiled there: LocalCompiler compiles the
                                               node's copy on the slot's own niced thread;
                                               the slot is taken until the copy is done
                                          no grammar within ``wait_s`` (WAIT_FACTOR x the
                                          limit, MIN_WAIT_S at least, wall) ->
                                          `CompileUnavailable`: the compile goes on, and a
                                          retry finds it
    AddRequest / AddPrefilled carry the CompiledGrammar: the engine thread never compiles,
    and evicting a grammar from this cache cannot make it compile there.

A slot holds its compile from the worker's proof to the node's copy, so the compiles
waiting (bounded above) are all there is: a proven grammar's copy never queues behind
another's, and a request waits for its grammar ``wait_s`` at most, never without end.

How each grammar ended is a `GrammarCompileOutcome` (the metric's label):

    CACHED, COMPILED         the request goes on
    INVALID                  400 "cannot be compiled: <xgrammar's message>"
    TIMEOUT, TOO_LARGE       400 "too complex to compile ...": the constraint's fault, so
                             not 503 (a retry would burn the same CPU and fail the same)
    REFUSED                  one of those three again, answered from memory at once
    UNCOMPILED               409 GRAMMAR_NOT_COMPILED: none of the above, and the request may
                             not compile (``compile_grammar`` false); nothing compiled
    BUSY, STARVED, CRASHED   503 + Retry-After: not the constraint's fault, not remembered
    LATE                     503 + Retry-After: not compiled within ``wait_s``; the compile
                             goes on (a retry shares it, or finds it compiled)

A timed-out, starved or dead worker is killed and started again (seconds) before its
slot takes the next compile. Workers start on the first structured request (each one
loads xgrammar, and with it torch: a few hundred MB), not with the node. Event loop only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from typing import Any, Callable

from aiohttp import web

from ..common.errors import InvalidRequest
from ..common.grammar_limits import MAX_CACHED_GRAMMARS
from ..common.http import error_response, msgpack_response
from ..common.outcomes import GrammarCompileOutcome as Outcome
from ..common.protocol import GRAMMAR_NOT_COMPILED, ErrorBody
from ..common.structured_outputs import FIELD, GrammarSpec, StructuredOutputsParams
from ..engine.sampling.grammar_worker import CompileWorker, LocalCompiler, WorkerResult
from ..engine.sampling.structured import KIND_FIELDS, start_state

log = logging.getLogger(__name__)
MAX_REFUSALS = 1024  # refused constraints remembered (each answered again without a compile)
MAX_CACHED_BYTES = 1 << 30  # compiled grammars kept, in xgrammar's memory_size_bytes
MAX_WAITING_PER_WORKER = 8  # compiles that may queue for one worker slot before a 503
# A request waits for its grammar this many times the compile's CPU limit in wall seconds (the
# worker's proof and the node's copy, each within the limit, on a busy CPU), and at least
# MIN_WAIT_S (a worker's start: spawn, import torch and xgrammar), then gets a 503.
WAIT_FACTOR = 3
MIN_WAIT_S = 30.0
RETRY_AFTER_S = 1


class CompileUnavailable(Exception):
    """No grammar now for a reason not the constraint's: answer 503 with Retry-After."""


class GrammarNotCompiled(Exception):
    """The request may not compile its grammar (``compile_grammar`` false) and this node
    holds it neither compiled nor compiling: answer `not_compiled_response`."""


def unavailable_response(message: str) -> web.Response:
    resp = error_response(503, message)
    resp.headers["Retry-After"] = str(RETRY_AFTER_S)
    return resp


def not_compiled_response(e: GrammarNotCompiled) -> web.Response:
    return msgpack_response(ErrorBody(message=str(e), param=FIELD, type=GRAMMAR_NOT_COMPILED), 409)


class GrammarService:
    def __init__(self, tokenizer_info: Callable[[], Any], workers: int, timeout_s: float, metrics: Any = None):
        """``tokenizer_info``: builds the model's xgrammar TokenizerInfo (seconds: run on a thread
        at the first structured request; GrammarCache.tokenizer_info); ``metrics``: NodeMetrics
        (``grammar_compiles``, ``grammar_compile_seconds``), or None."""
        assert workers >= 1 and timeout_s > 0
        self._tokenizer_info = tokenizer_info
        self._size = workers
        self.timeout_s = timeout_s  # CPU seconds one compile may take
        self._metrics = metrics
        self.wait_s = max(MIN_WAIT_S, WAIT_FACTOR * timeout_s)  # wall seconds a request waits for its grammar
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()  # -> CompiledGrammar, LRU
        self._refused: OrderedDict[GrammarSpec, InvalidRequest] = OrderedDict()  # LRU
        self._compiling: dict[GrammarSpec, asyncio.Task[Any]] = {}  # one compile per spec at a time
        self._idle: asyncio.Queue[CompileWorker] | None = None  # free worker slots, once started
        self._starting: asyncio.Task[None] | None = None
        self._workers: list[CompileWorker] = []
        self._local: LocalCompiler | None = None  # the node's copies, once started
        self._cached_bytes = 0  # memory_size_bytes of what _compiled holds
        self._tasks: set[asyncio.Task[Any]] = set()  # restarts in flight (tasks are weak refs)
        self._waiting = 0  # compiles waiting for a slot
        self.copying = 0  # the node's copies compiling now (one per slot at most)
        self.counts: dict[Outcome, int] = {o: 0 for o in Outcome}  # for tests and /debug/state

    async def grammar(self, params: StructuredOutputsParams, may_compile: bool = True) -> Any:
        """The CompiledGrammar of validated ``params``, its ``resume_token_ids`` checked.
        Raises `InvalidRequest` naming ``structured_outputs.<field>`` (a 400),
        `CompileUnavailable` (a 503), or `GrammarNotCompiled` when it would have to compile
        one and not ``may_compile``."""
        spec = params.spec()
        compiled = self._compiled.get(spec)
        if compiled is not None:
            self._compiled.move_to_end(spec)
            self._count(Outcome.CACHED)
        else:
            refusal = self._refused.get(spec)
            if refusal is not None:
                self._refused.move_to_end(spec)
                self._count(Outcome.REFUSED)
                raise refusal
            task = self._compiling.get(spec)
            if task is None:
                if not may_compile:
                    self._count(Outcome.UNCOMPILED)
                    raise GrammarNotCompiled("this node does not hold the grammar compiled, and the request may "
                                             "not compile it")
                if self._waiting >= MAX_WAITING_PER_WORKER * self._size:
                    self._count(Outcome.BUSY)
                    raise CompileUnavailable(f"{self._waiting} grammar compiles already wait on this node")
                task = self._compiling[spec] = asyncio.create_task(self._compile(spec))
                task.add_done_callback(functools.partial(self._done, spec))
            try:  # shielded: a request that goes away, or gives up, leaves the compile be
                compiled = await asyncio.wait_for(asyncio.shield(task), self.wait_s)
            except TimeoutError:
                self._count(Outcome.LATE)
                raise CompileUnavailable(f"the grammar is still compiling after {self.wait_s:g} s on this node; "
                                         "retry") from None
        if params.resume_token_ids:
            start_state(compiled, params)  # raises InvalidRequest if the grammar refuses them
        return compiled

    def _done(self, spec: GrammarSpec, task: asyncio.Task[Any]) -> None:
        self._compiling.pop(spec, None)
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone (it stays in the LRUs)

    async def _compile(self, spec: GrammarSpec) -> Any:
        field = f"{FIELD}.{KIND_FIELDS[spec.kind]}"
        self._waiting += 1
        try:
            idle = await self._slots()
            worker = await idle.get()
        finally:
            self._waiting -= 1
        t0 = time.monotonic()
        try:
            result: WorkerResult = await asyncio.to_thread(worker.compile, spec, self.timeout_s)
            if result.outcome is Outcome.COMPILED:  # proven: the node's copy takes as long, once more
                compiled = await self._copy(spec)
                self._count(result.outcome, time.monotonic() - t0)
                self._cache(spec, compiled)
                return compiled
        finally:
            self._give_back(worker)
        self._count(result.outcome, time.monotonic() - t0)
        if result.outcome is Outcome.INVALID:
            error = InvalidRequest(field, f"cannot be compiled: {result.detail}")
        elif result.outcome in (Outcome.TIMEOUT, Outcome.TOO_LARGE):
            what = (f"it took over {self.timeout_s:g} CPU seconds (the node's --grammar-compile-timeout)"
                    if result.outcome is Outcome.TIMEOUT else f"its compiled grammar is too large ({result.detail})")
            error = InvalidRequest(field, f"too complex to compile: {what}; use fewer distinct string length "
                                   "bounds, patterns and repetitions, or smaller ones")
        else:  # STARVED, CRASHED: this node's trouble, not the constraint's
            log.warning("grammar compile %s: %s", result.outcome, result.detail)
            raise CompileUnavailable(f"this node could not compile the grammar now ({result.outcome}); retry")
        self._remember(self._refused, spec, error, MAX_REFUSALS)
        raise error

    async def _copy(self, spec: GrammarSpec) -> Any:
        """The node's own copy of a proven grammar, on a thread of the slot's: never queued
        (``workers`` threads, one per slot, and the caller holds a slot)."""
        assert self._local is not None
        self.copying += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._local.executor, self._local.compile, spec)
        finally:
            self.copying -= 1

    async def _slots(self) -> asyncio.Queue[CompileWorker]:
        """The idle-worker queue, once the workers' tokenizer info is built (the first
        structured request: seconds, on a thread)."""
        if self._starting is None:
            self._starting = asyncio.create_task(self._start())
        try:
            await asyncio.shield(self._starting)
        except InvalidRequest:
            self._starting = None  # no tokenizer: every structured request says so
            raise
        assert self._idle is not None
        return self._idle

    async def _start(self) -> None:
        info = await asyncio.to_thread(self._tokenizer_info)
        self._local = LocalCompiler(info, self._size)
        self._workers = [CompileWorker(info) for _ in range(self._size)]
        self._idle = asyncio.Queue()
        for w in self._workers:
            self._idle.put_nowait(w)  # each process starts on its first compile

    def _give_back(self, worker: CompileWorker) -> None:
        """Back to the idle queue; a killed one after it restarted (on a thread)."""
        assert self._idle is not None
        if worker.alive:
            self._idle.put_nowait(worker)
            return

        async def restart() -> None:
            try:
                await asyncio.to_thread(worker.start)
            except RuntimeError:
                log.exception("grammar compile worker restart failed (the next compile tries again)")
            finally:
                assert self._idle is not None
                self._idle.put_nowait(worker)

        task = asyncio.create_task(restart())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _count(self, outcome: Outcome, seconds: float | None = None) -> None:
        self.counts[outcome] += 1
        if self._metrics is not None:
            self._metrics.grammar_compiles.labels(outcome).inc()
            if seconds is not None:
                self._metrics.grammar_compile_seconds.observe(seconds)

    def _cache(self, spec: GrammarSpec, compiled: Any) -> None:
        self._compiled[spec] = compiled
        self._cached_bytes += compiled.memory_size_bytes
        while len(self._compiled) > MAX_CACHED_GRAMMARS or (self._cached_bytes > MAX_CACHED_BYTES
                                                            and len(self._compiled) > 1):
            _, old = self._compiled.popitem(last=False)  # a request holding it keeps it alive
            self._cached_bytes -= old.memory_size_bytes

    @staticmethod
    def _remember(lru: OrderedDict, spec: GrammarSpec, value: Any, limit: int) -> None:
        lru[spec] = value
        while len(lru) > limit:
            lru.popitem(last=False)

    def close(self) -> None:
        """Kill every worker (the node is stopping)."""
        for task in [*self._tasks, *self._compiling.values()]:
            task.cancel()
        for w in self._workers:
            w.kill()
        if self._local is not None:
            self._local.close()
