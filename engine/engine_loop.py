"""EngineLoop: runs an EngineCore on its own thread so that network I/O never
stalls a step and a long forward pass never stalls the sockets.

    asyncio side                          engine thread
    ------------                          -------------
    await loop.call(fn, *args)  --queue-->  fn(engine, *args) between steps
    on_deltas(deltas)  <--call_soon_threadsafe--  engine.step()
    on_kv_events(events, None)  <--------------  engine.kv.take_events() after each pass
    request_kv_snapshot()  ----flag---> on_kv_events([], every cached hash)

The engine is touched only on its thread; everything else talks to it through
``call``. Owns no sockets. This thread is the only drainer of the prefix-cache
events, so a snapshot and the event batches reach the event loop in engine order:
a snapshot replaces every batch handed over before it.
"""

import asyncio
import logging
import queue
import threading
from typing import Any, Callable

from splitserve.common.kv_events import KVEvent
from splitserve.engine.engine_core import EngineCore, RequestDelta

log = logging.getLogger(__name__)


# (events since the last call, or [] with a snapshot; every cached hash, or None)
KVEventsCallback = Callable[[list[KVEvent], "list[int] | None"], None]


class EngineLoop:
    def __init__(self, engine: EngineCore, aio_loop: asyncio.AbstractEventLoop,
                 on_deltas: Callable[[list[RequestDelta]], None],
                 on_kv_events: KVEventsCallback | None = None):
        self.engine = engine
        self._aio = aio_loop
        self._on_deltas = on_deltas
        self._on_kv_events = on_kv_events  # None: events are drained and dropped
        self._snapshot_wanted = False
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # (fn, args, future)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0
        self.load = engine.load()  # refreshed on the engine thread after every step; read anywhere

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=10)

    async def call(self, fn: Callable[..., Any], *args) -> Any:
        """Run ``fn(engine, *args)`` on the engine thread; its result or exception comes back here."""
        fut = self._aio.create_future()
        self._commands.put((fn, args, fut))
        return await fut

    def request_kv_snapshot(self) -> None:
        """Ask for ``on_kv_events([], hashes)`` with every hash cached now, after the
        event batches already drained (from any thread; at most one per request)."""
        self._snapshot_wanted = True
        self._commands.put(None)  # wakes an idle engine thread

    def _drain_kv_events(self) -> None:
        events = self.engine.kv.take_events()
        if self._on_kv_events is None:
            return
        if self._snapshot_wanted:
            self._snapshot_wanted = False  # the drained events are part of the snapshot
            self._aio.call_soon_threadsafe(self._on_kv_events, [], self.engine.kv.cached_hashes())
        elif events:
            self._aio.call_soon_threadsafe(self._on_kv_events, events, None)

    def call_soon(self, fn: Callable[..., Any], *args) -> None:
        """From the engine thread: run ``fn(*args)`` on the event loop."""
        self._aio.call_soon_threadsafe(fn, *args)

    def _resolve(self, fut: asyncio.Future, result, exc) -> None:
        if fut.cancelled():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _run_command(self, item) -> None:
        fn, args, fut = item
        try:
            result, exc = fn(self.engine, *args), None
        except Exception as e:  # handed to the awaiting coroutine, which decides
            result, exc = None, e
        self._aio.call_soon_threadsafe(self._resolve, fut, result, exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            try:  # block only when there is nothing to compute
                item = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                self._run_command(item)
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    item = None
                self.load = self.engine.load()
            if self._stop.is_set():
                break
            if self.engine.has_unfinished():
                try:
                    deltas = self.engine.step()
                except Exception:  # a bug must not hang every client: fail what was running
                    log.exception("engine step failed; failing %d requests", len(self.engine.scheduler.requests))
                    deltas = [RequestDelta(rid, [], [], "error", 0) for rid in list(self.engine.scheduler.requests)]
                    for d in deltas:
                        self.engine.abort(d.request_id, "error")
                self.steps += 1
                self.load = self.engine.load()
                if deltas:
                    self._aio.call_soon_threadsafe(self._on_deltas, deltas)
            self._drain_kv_events()
