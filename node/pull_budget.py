"""A holder's budget for the prefix pulls it serves (node/pull_holder.py ``PullHolder``): one
budget for all of them, so N pullers of a hot prefix cost its running batch what one does.

Owns, across every pull one node serves at once:

- **time**: a pull's blocks are copied out on the engine thread between two steps, in
  chunks (``ExportCached``), one chunk at a time for the whole node, the pulls taking turns
  in the order they asked. While the holder runs requests, the chunks take at most
  PULL_STEP_SHARE of its step per step, all pulls together: a credit of copy seconds grows at
  PULL_STEP_SHARE of the wall time the engine does not spend copying, up to PULL_STEP_SHARE
  of its recent mean step; each chunk is sized to fit it and charged what it measured to cost
  (engine/copy_timer.py: the whole chunk, lower-tier reads, checks and loads included, and on
  a GPU the device time of its copies), and a chunk that cost more leaves a debt the next one
  waits out. An idle holder copies up to a mean step per chunk, back to back::

      engine thread   | step | c | step | c | step | c' | step |  step  | c | ...
      credit          ^ grows at share x wall time, capped at share x mean step; each c takes
                        what it cost; c' cost more than the credit: the debt skips a gap

- **memory**: the bytes packed for pulls and not yet sent (one fresh buffer per chunk), all
  pulls together, at most ``max_bytes`` (``--kv-pull-memory``): a chunk is as many blocks as
  fit, and waits for a sent chunk's bytes when not one does.
- **concurrency**: at most PULLS_SERVED_MAX pulls at once; ``admit`` refuses more (the holder
  answers 503 at once and the puller computes the prefix instead of queueing behind them).

It publishes what a pull from this node costs now (``load``: the pulls it serves and the rate
it copies blocks out at, which the router prices: router/routing/pull_cost.py). Must not touch
the engine or a socket: the holder asks before each chunk and reports after it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from ..engine.engine_thread import EngineStats

PULL_STEP_SHARE = 0.1  # of a busy holder's mean step: the most its pulls' copies may add to a step, all together
PULL_PROBE_BLOCKS = 16  # a holder's first chunk, before it measured its copy rate
# Pulls one node serves at once. The pulls take turns, so each of N waits about N chunks (N steps
# of a busy holder) between two of its own; more of them would outwait their lease (kv_pull.py
# PULL_LEASE_S) on a slow holder, and computing the prefix is then the better answer.
PULLS_SERVED_MAX = 8
STEP_EWMA = 0.2  # weight of the latest steps in the mean step the budget is a share of


def pull_chunk_blocks(left: int, budget_s: float, block_copy_s: float | None) -> int:
    """Blocks of the next chunk, of ``left`` still wanted, whose copy fits ``budget_s`` seconds
    at ``block_copy_s`` seconds per block (None: not measured yet, PULL_PROBE_BLOCKS; a budget of
    0 or less: no mean step measured yet, the probe too). At least one block, so a pull
    progresses."""
    if block_copy_s is None or budget_s <= 0:
        return min(left, PULL_PROBE_BLOCKS)
    if block_copy_s <= 0:
        return left
    fits = budget_s / block_copy_s * (1 + 1e-9)  # float rounding
    return left if fits >= left else max(1, int(fits))


class PullLoad(NamedTuple):
    """What a pull from this node costs now (its heartbeat's ``NodeLoad``)."""
    serving: int  # pulls it serves
    bytes_per_s: float  # the rate it copies blocks out for them, all together (0.0: not measured)


class PullBudget:
    """One node's budget for the pulls it serves. ``stats``: the engine thread's published
    ``EngineStats`` (load, steps, busy seconds), read at each chunk; ``clock`` and ``sleep``:
    monotonic seconds and how to wait for them (injectable, so a test runs the budget in
    virtual time). Event loop only."""

    def __init__(self, max_bytes: int, stats: Callable[[], EngineStats],
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        assert max_bytes > 0, f"max_bytes must be > 0, got {max_bytes}"
        self.max_bytes = max_bytes
        self._stats = stats
        self._clock = clock
        self._sleep = sleep
        self.serving = 0  # pulls admitted and not done
        self.refused = 0  # pulls refused at PULLS_SERVED_MAX, since start
        self.packed_bytes = 0  # held by chunks granted and not yet sent
        self.peak_bytes = 0  # the most packed_bytes ever was
        self.copy_s = 0.0  # seconds charged since start (a metric)
        self.block_copy_s: float | None = None  # a block's cost, measured on the last chunk
        self._credit_s = 0.0  # copy seconds a busy holder may spend now (negative: a debt)
        self._credit_at = clock()  # when the credit last grew
        self._step_s = 0.0  # the recent mean step (STEP_EWMA over the steps since the last look)
        self._seen = (0, 0.0)  # (steps, busy seconds) at the last look
        self._turn = asyncio.Lock()  # one chunk at a time; waiters in arrival order
        self._freed = asyncio.Event()  # packed bytes were released

    # ---- a pull's life -------------------------------------------------------------------------
    def admit(self) -> bool:
        """Take a pull on (then ``leave`` once it ended); False at PULLS_SERVED_MAX."""
        if self.serving >= PULLS_SERVED_MAX:
            self.refused += 1
            return False
        self.serving += 1
        return True

    def leave(self) -> None:
        assert self.serving > 0, "leave() without admit()"
        self.serving -= 1

    def turn(self) -> asyncio.Lock:
        """Held from ``grant`` until the chunk was copied (``async with budget.turn():``)."""
        return self._turn

    # ---- one chunk -----------------------------------------------------------------------------
    async def grant(self, left: int, block_bytes: int) -> int:
        """Under ``turn``: the blocks the next chunk may copy, of ``left`` still wanted, each
        ``block_bytes`` packed. Waits for the time credit (a busy holder) and for packed bytes
        to be released; holds the chunk's bytes until ``release``."""
        assert self._turn.locked(), "grant() under turn()"
        assert block_bytes <= self.max_bytes, f"a {block_bytes}-byte block over a {self.max_bytes}-byte budget"
        budget_s = await self._credit()
        n = pull_chunk_blocks(left, budget_s, self.block_copy_s)
        while (fit := (self.max_bytes - self.packed_bytes) // block_bytes) < 1:
            self._freed.clear()
            await self._freed.wait()
        n = min(n, fit)
        self.packed_bytes += n * block_bytes
        self.peak_bytes = max(self.peak_bytes, self.packed_bytes)
        return n

    async def _credit(self) -> float:
        """The copy seconds the next chunk may take: a busy holder's credit once it is
        positive (waited for), an idle one's mean step; 0.0 before any step was measured."""
        while True:
            busy, step_s = self._look()
            now = self._clock()
            if not busy or step_s <= 0:
                self._credit_s, self._credit_at = PULL_STEP_SHARE * step_s, now  # a busy start gets a share
                return step_s
            cap = PULL_STEP_SHARE * step_s
            grown = max(0.0, now - self._credit_at) * PULL_STEP_SHARE
            self._credit_s = min(cap, self._credit_s + grown)
            self._credit_at = max(self._credit_at, now)
            enough = min(self.block_copy_s or 0.0, cap)  # a block's copy, or a whole share when one costs more
            if self._credit_s > 0 and self._credit_s >= enough:
                return self._credit_s
            await self._sleep(min((enough - self._credit_s) / PULL_STEP_SHARE + 1e-4, step_s))

    def _look(self) -> tuple[bool, float]:
        """(the holder runs requests, its recent mean step in seconds) from the engine's stats."""
        stats = self._stats()
        steps, busy_s = self._seen
        if stats.steps > steps:
            mean = (stats.busy_s - busy_s) / (stats.steps - steps)
            self._step_s = mean if not self._step_s else (1 - STEP_EWMA) * self._step_s + STEP_EWMA * mean
            self._seen = (stats.steps, stats.busy_s)
        return stats.load.running + stats.load.waiting > 0, self._step_s

    def charge(self, seconds: float) -> None:
        """A chunk's copy cost ``seconds`` (of the engine thread; on a GPU, also of its device,
        told once it ran): taken from the credit, and not time the credit grows in."""
        self._credit_s -= seconds
        self._credit_at += seconds
        self.copy_s += seconds

    def measured(self, blocks: int, seconds: float) -> None:
        """A chunk of ``blocks`` cost ``seconds`` in all: what the next chunks are sized by."""
        if blocks > 0:
            self.block_copy_s = seconds / blocks

    def release(self, nbytes: int) -> None:
        """Packed bytes no longer held (sent, or never packed)."""
        assert 0 <= nbytes <= self.packed_bytes, f"release({nbytes}) of {self.packed_bytes} held"
        self.packed_bytes -= nbytes
        self._freed.set()

    # ---- what others read --------------------------------------------------------------------
    def load(self, block_bytes: int) -> PullLoad:
        """The pulls served now and the rate, in bytes of ``block_bytes``-byte blocks per second,
        this node copies blocks out for them: a busy holder's share of its time, an idle one's
        whole (0.0 before a chunk was measured)."""
        if not self.block_copy_s:
            return PullLoad(self.serving, 0.0)
        stats = self._stats()
        busy = stats.load.running + stats.load.waiting > 0
        return PullLoad(self.serving, (PULL_STEP_SHARE if busy else 1.0) * block_bytes / self.block_copy_s)

    def state(self) -> dict:
        """Its part of ``/debug/state``."""
        return {"serving": self.serving, "refused": self.refused, "packed_bytes": self.packed_bytes,
                "packed_bytes_peak": self.peak_bytes, "max_bytes": self.max_bytes,
                "copy_s": round(self.copy_s, 6), "block_copy_s": self.block_copy_s}
