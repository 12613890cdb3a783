"""Grammar compiles off a node's engine, bounded: a worker process proves a grammar
compiles within a CPU-time limit (and is killed when it does not), then the node
compiles its own copy on a niced thread (one per worker slot).

    caller (a thread of the node's      worker process (python -m this module; niceness
    GrammarService)                     WORKER_NICENESS, one xgrammar thread, no cache)
    ---------------------------------   ---------------------------------------------------
    CompileWorker.start() --TokenizerInfo JSON-->  import xgrammar, read it
                          <-- "ready"
    CompileWorker.compile(spec, limit_s) --(kind, source, any_whitespace, limit_s)-->
                                         CPU limit = CPU used + limit_s (RLIMIT_CPU: the
                                         kernel kills it with SIGXCPU past that), compile
                          <-- (COMPILED, bytes) | (INVALID, message) | (TOO_LARGE, bytes)
    COMPILED: LocalCompiler.compile(spec) on one of its threads (niced, one xgrammar thread each)

The limit is CPU time, so a compile that waits for a busy CPU (the worker runs niced,
behind the engine) is not refused for it; a wall-clock cap of WALL_FACTOR times the
limit ends a starved one (STARVED). A worker killed or dead is gone for good: the caller
starts a new one.

Why compile twice rather than move the worker's result back: CompiledGrammar's only
serialization is xgrammar's ``serialize_json``, and it costs more than compiling again
(a string of maxLength 128, twice: compile 3.1 s, serialize 1.1 s into 24 MB of JSON,
deserialize 0.7 s); for a schema of a few hundred formats and anyOf branches (17 MB
compiled, 4 s) it ran past 6 GB of memory. The second compile repeats work the worker
just finished within the limit (xgrammar is deterministic), so it is bounded too; it
releases the GIL (the event loop stalled at most 29 ms while one ran).

Blocking: run these calls off the event loop. Must not know about HTTP or requests.
"""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from ...common.outcomes import GrammarCompileOutcome
from ...common.structured_outputs import GrammarKind, GrammarSpec

WORKER_NICENESS = 19  # the engine and the event loop come first
WALL_FACTOR = 8  # wall seconds a compile may take per CPU second of its limit
MAX_COMPILED_BYTES = 64 << 20  # a compiled grammar's memory; the limits keep one far below (21 MB)
WORKER_MEMORY_BYTES = 4 << 30  # address space a worker may add past its imports (RLIMIT_AS)
START_TIMEOUT_S = 120.0  # spawn + import torch and xgrammar on a loaded machine
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: " and may add "Check failed: ...: "
XGR_PREFIX = re.compile(r"^(\[[\d:]+\] \S+:\d+: )?(Check failed: .*? is false: )?")


class WorkerResult(NamedTuple):
    outcome: GrammarCompileOutcome
    detail: str  # INVALID: xgrammar's message; else what to log
    cpu_s: float  # CPU seconds the worker spent on it (0.0 when unknown)


class CompileWorker:
    """One worker process: one caller compiles at a time (the service's slots); `kill` may
    come from any thread, at any time."""

    def __init__(self, tokenizer_info: Any):
        self._info_json = tokenizer_info.serialize_json()  # of the xgrammar.TokenizerInfo
        self._lock = threading.Lock()  # guards _proc and _conn being replaced
        self._proc: subprocess.Popen | None = None  # once started
        self._conn: Connection | None = None
        self.compiles = 0  # grammars this worker (and its predecessors) compiled

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """A fresh process, once it has loaded xgrammar (seconds). Raises RuntimeError if it
        does not come up. A plain ``python -m`` child (never a fork of a process with an
        engine's threads, and unlike multiprocessing's spawn, no re-run of our __main__)."""
        self.kill()
        ours, theirs = socket.socketpair()
        with self._lock:
            proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
            conn = Connection(ours.detach())
            self._proc, self._conn = proc, conn
        theirs.close()
        try:
            conn.send(self._info_json)
        except OSError:
            pass  # it died already: _ready says so
        if not _ready(conn):
            self.kill()
            raise RuntimeError("the grammar compile worker did not start")

    def compile(self, spec: GrammarSpec, limit_s: float) -> WorkerResult:
        """Whether ``spec`` compiles within ``limit_s`` CPU seconds (and how it does not). A
        worker that timed out, starved or died is killed: ``start()`` it again next."""
        if not self.alive:
            self.start()
        proc, conn = self._proc, self._conn
        if proc is None or conn is None:  # killed meanwhile (the node is stopping)
            return WorkerResult(GrammarCompileOutcome.CRASHED, "the worker was stopped", 0.0)
        try:
            conn.send((spec.kind.value, spec.source, spec.any_whitespace, limit_s))
            answered = conn.poll(limit_s * WALL_FACTOR)
        except OSError:
            answered = True  # its pipe closed: read below as a death
        if not answered:
            self.kill()
            return WorkerResult(GrammarCompileOutcome.STARVED, f"no answer within {limit_s * WALL_FACTOR:g} s", 0.0)
        answer = _recv(conn)
        if answer is None:  # it died: SIGXCPU past its CPU limit, or killed (memory, the node stopping)
            try:
                code = proc.wait(5.0)
            except subprocess.TimeoutExpired:
                code = None
            self.kill()
            if code is not None and code < 0 and -code == _SIGXCPU:
                return WorkerResult(GrammarCompileOutcome.TIMEOUT, f"over {limit_s:g} CPU s", limit_s)
            return WorkerResult(GrammarCompileOutcome.CRASHED, f"the worker died (exit code {code})", 0.0)
        outcome, detail, cpu_s = answer
        self.compiles += 1
        return WorkerResult(GrammarCompileOutcome(outcome), detail, cpu_s)

    def kill(self) -> None:
        """Stop the process now (SIGKILL); a no-op without one."""
        with self._lock:
            proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if conn is not None:
            conn.close()


def _ready(conn: Connection) -> bool:
    try:
        return conn.poll(START_TIMEOUT_S) and _recv(conn) == "ready"
    except OSError:  # killed meanwhile: its pipe closed
        return False


_SIGXCPU = 24  # Linux; the worker's RLIMIT_CPU signal


def _recv(conn: Connection) -> Any:
    try:
        return conn.recv()
    except (EOFError, OSError, TypeError):  # TypeError: closed by kill() while reading
        return None


def _serve(conn: Connection) -> None:
    """The worker process: compile what arrives until the pipe closes."""
    import resource

    os.nice(WORKER_NICENESS)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU dumps no core
    import xgrammar as xgr
    info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the node caches
    vm = _address_space()
    if vm is not None:  # a compile that wants more memory fails (bad_alloc), the host stays up
        resource.setrlimit(resource.RLIMIT_AS, (vm + WORKER_MEMORY_BYTES, resource.RLIM_INFINITY))
    conn.send("ready")
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    while True:
        try:
            kind, source, any_ws, limit_s = conn.recv()
        except EOFError:
            return
        used = resource.getrusage(resource.RUSAGE_SELF)
        spent = used.ru_utime + used.ru_stime
        soft = math.ceil(spent + limit_s)
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        try:
            size = compile_spec(compiler, GrammarSpec(GrammarKind(kind), source, any_ws)).memory_size_bytes
        except RuntimeError as e:  # xgrammar reports every bad schema, regex or grammar so
            answer: tuple = (GrammarCompileOutcome.INVALID.value, XGR_PREFIX.sub("", str(e)).strip())
        except MemoryError:
            answer = (GrammarCompileOutcome.TOO_LARGE.value, f"over {WORKER_MEMORY_BYTES >> 20} MiB to compile")
        else:
            answer = ((GrammarCompileOutcome.TOO_LARGE.value, f"{size >> 20} MiB compiled")
                      if size > MAX_COMPILED_BYTES else (GrammarCompileOutcome.COMPILED.value, f"{size} bytes"))
        used = resource.getrusage(resource.RUSAGE_SELF)
        conn.send((*answer, used.ru_utime + used.ru_stime - spent))


def _address_space() -> int | None:
    """This process's virtual memory size in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


class LocalCompiler:
    """A node's own copy of each grammar a worker proved: compiled on ``threads`` threads of
    this process (one per worker slot: a copy never waits for another), each niced like the
    workers (Linux sets a thread's niceness alone), with its own compiler of one xgrammar
    thread. ``compile`` blocks: submit it to ``executor``."""

    def __init__(self, tokenizer_info: Any, threads: int = 1):
        from concurrent.futures import ThreadPoolExecutor
        self._info = tokenizer_info
        self._thread = threading.local()  # .compiler: made on each thread (xgrammar's pool inherits its niceness)
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile", initializer=self._init)

    def _init(self) -> None:
        import xgrammar as xgr
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)
        except (OSError, AttributeError):
            pass  # not Linux: the thread runs at the process's priority
        self._thread.compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> Any:
        """``spec`` (one a worker compiled) -> xgrammar.CompiledGrammar. On ``executor`` only."""
        return compile_spec(self._thread.compiler, spec)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def compile_spec(compiler: Any, spec: GrammarSpec) -> Any:
    """``spec`` -> xgrammar.CompiledGrammar (RuntimeError: it does not compile)."""
    if spec.kind is GrammarKind.JSON:
        return compiler.compile_json_schema(spec.source, any_whitespace=spec.any_whitespace)
    if spec.kind is GrammarKind.JSON_OBJECT:  # OpenAI's json_object: an object, not any JSON value
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace)
    if spec.kind is GrammarKind.REGEX:
        return compiler.compile_regex(spec.source)
    if spec.kind is GrammarKind.CHOICE:  # JSON string literals are valid EBNF literals
        import json
        return compiler.compile_grammar("root ::= " + " | ".join(
            json.dumps(c, ensure_ascii=False) for c in json.loads(spec.source)))
    return compiler.compile_grammar(spec.source)


if __name__ == "__main__":  # the worker process (CompileWorker.start)
    _serve(Connection(int(sys.argv[1])))
