"""How long a stretch of engine-thread work that copies KV blocks cost: what a prefix pull's
chunk (engine_thread.py ``ExportCached``) is charged against its holder's copy budget
(node/pull_budget.py).

Owns ``CopyTimer`` (started before the work, stopped after it) and ``CopyTime``. Must not wait
for the device on the engine thread: with async scheduling a step is in flight there, and
waiting for it would both stall the next launch and charge the step's forward to the copy.

    host_s     wall seconds on the engine thread, all of it: the prefix-cache lookup, a lower
               tier's reads and checks (disk file, MAC), the host-to-device loads it waits for
               on the CPU, the copy (a memcpy on the CPU: done on return)
    device_s   on a GPU, the device time of what the work queued on the engine's stream (the
               lower-tier loads it waits for, the gather), between two events recorded around
               it: the first completes when the step queued before it does, so the step's
               forward is not counted. Read once the copy is known to have run (the packed
               blocks were sent); 0.0 on the CPU.

Host and device time are added: on a GPU the host part may overlap the step in flight, so the
sum can only overstate the copy's cost to the holder's steps.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch


class CopyTime(NamedTuple):
    host_s: float
    start: torch.cuda.Event | None = None  # CUDA: recorded on the engine's stream before the work
    end: torch.cuda.Event | None = None  # and after it

    def device_s(self) -> float:
        """The device seconds of the work queued (waits for it to have run; 0.0 on the CPU)."""
        if self.start is None or self.end is None:
            return 0.0
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


class CopyTimer:
    """``CopyTimer(device)`` before the work, ``stop()`` after it, on the same thread."""

    def __init__(self, device: torch.device):
        self._start: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(device))
        self._device = device
        self._t0 = time.perf_counter()

    def stop(self) -> CopyTime:
        host_s = time.perf_counter() - self._t0
        if self._start is None:
            return CopyTime(host_s)
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self._device))
        return CopyTime(host_s, self._start, end)
