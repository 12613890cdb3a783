"""When each request is sent: offsets in seconds from the start of a run.

A concurrency cap (runner.py) applies on top: a request whose time has come waits
for a free slot, so ``rate=inf`` with a cap of C is a closed loop of C streams.
"""

from __future__ import annotations

import math
import random

from .datasets import RequestSpec


def poisson_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Poisson arrivals at ``rate`` requests/s (exponential gaps); ``inf``: all at 0.
    The first request goes at 0."""
    if rate <= 0:
        raise ValueError(f"--request-rate: must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def trace_offsets(specs: list[RequestSpec]) -> list[float] | None:
    """The dataset's own schedule, or None when a spec has no timestamp."""
    offsets = [s.timestamp_s for s in specs if s.timestamp_s is not None]
    return offsets if len(offsets) == len(specs) else None


def fixed_offsets(n: int, interval_s: float, start_s: float = 0.0) -> list[float]:
    """One request every ``interval_s`` seconds from ``start_s``."""
    return [start_s + i * interval_s for i in range(n)]
