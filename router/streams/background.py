"""Fire-and-forget work of the router that must outlive the request that started
it (aborting a request on a node after its client disconnected, when the handler
itself is being cancelled).

Owns references to those tasks, so they are not garbage-collected mid-flight and
the app's lifespan can wait for them before it closes the HTTP client they use.
Must not run anything long: each task is a single short call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BackgroundTasks:
    _tasks: set[asyncio.Task] = field(default_factory=set)

    def spawn(self, coro: Coroutine, name: str | None = None) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait up to ``timeout_s`` for pending tasks, then cancel the rest."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
