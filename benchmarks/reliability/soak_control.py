"""The soak's control (bench_soak.py): the aged cluster's latency is judged against a
FRESH cluster's latency measured at the same moments, not against its own first window,
so the shared machine's load (which moves p99 by 3x between windows) cancels out of the
drift figure.

    time ->   aged   A . A . A . A . A ...      request 2k   -> aged cluster
              fresh  . F . F . F . F . F ...    request 2k+1 -> fresh cluster, same prompt

One open-loop stream alternates between the two routers, so each pair of requests
shares the machine's load; drift = p99(aged) / p99(fresh) - 1 over the control window.

Owns: ``run_interleaved`` (the alternating stream), ``Drift`` and ``control_drift``
(the figure, with a paired bootstrap interval). Must not start or stop clusters
(bench_soak does) nor judge memory (bench_soak's RSS samples do).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import NamedTuple

import aiohttp
from splitserve.benchmarks.harness import Outcome, RequestResult, stream_request


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile by rank (the value below which ``q`` of the sample lies)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


class Drift(NamedTuple):
    pairs: int  # request pairs where both the aged and the fresh request succeeded
    p50_aged_s: float
    p50_fresh_s: float
    p99_aged_s: float
    p99_fresh_s: float
    p50_ratio: float  # p50(aged) / p50(fresh)
    p99_ratio: float  # p99(aged) / p99(fresh)
    p99_drift: float  # p99_ratio - 1: the target figure (want < 0.10)
    p99_drift_ci90: tuple[float, float]  # paired bootstrap 5th..95th percentile of p99_drift


def control_drift(pairs: list[tuple[float, float]], resamples: int = 2000, seed: int = 0) -> Drift:
    """Drift from ``pairs`` of (aged latency, fresh latency) in seconds, each pair sent
    one request interval apart. The interval resamples whole pairs, so it keeps the load
    both requests of a pair shared: it says how far p99's sampling noise alone moves the ratio."""
    if not pairs:
        raise ValueError("control_drift: no request pair where both clusters succeeded")
    aged, fresh = [a for a, _ in pairs], [f for _, f in pairs]
    p99a, p99f = percentile(aged, 0.99), percentile(fresh, 0.99)
    p50a, p50f = percentile(aged, 0.5), percentile(fresh, 0.5)
    rng = random.Random(seed)
    boot = []
    for _ in range(resamples):
        sample = rng.choices(pairs, k=len(pairs))
        boot.append(percentile([a for a, _ in sample], 0.99) / percentile([f for _, f in sample], 0.99) - 1)
    return Drift(len(pairs), round(p50a, 4), round(p50f, 4), round(p99a, 4), round(p99f, 4),
                 round(p50a / p50f, 3), round(p99a / p99f, 3), round(p99a / p99f - 1, 3),
                 (round(percentile(boot, 0.05), 3), round(percentile(boot, 0.95), 3)))


async def run_interleaved(urls: list[str], rate_per_cluster: float, duration_s: float, prompts: list[str],
                          max_tokens: int) -> list[list[RequestResult]]:
    """Open-loop stream at ``rate_per_cluster * len(urls)`` req/s for ``duration_s``:
    request i goes to ``urls[i % len(urls)]`` with prompt ``i // len(urls)``, so every
    cluster gets the same prompts at the same rate, one slot apart. Returns the results
    per url, in send order (result k of each list form pair k)."""
    n = len(urls)
    tasks: list[list[asyncio.Task]] = [[] for _ in urls]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.monotonic()
        i = 0
        while time.monotonic() < t0 + duration_s or i % n:  # whole rounds: every cluster as many requests
            tasks[i % n].append(asyncio.create_task(
                stream_request(session, urls[i % n], prompts[(i // n) % len(prompts)], max_tokens)))
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / (rate_per_cluster * n) - time.monotonic()))  # no drift
        return [list(await asyncio.gather(*ts)) for ts in tasks]


def ok_pairs(aged: list[RequestResult], fresh: list[RequestResult], after: float) -> list[tuple[float, float]]:
    """(aged, fresh) latencies of the pairs sent at or after monotonic time ``after`` where both succeeded."""
    return [(a.ended - a.started, f.ended - f.started) for a, f in zip(aged, fresh, strict=True)
            if a.started >= after and a.outcome is Outcome.OK and f.outcome is Outcome.OK]
