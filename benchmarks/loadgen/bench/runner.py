"""A run: every spec sent at its offset, under a concurrency cap, over one pooled
HTTP session, with a progress bar. Returns every request's result (failures
included) and the run's duration, from the first send to the last answer.

The cap is one number for all requests, or per tag (``{"short": 16}``: at most 16
"short" requests in flight, other tags uncapped), so a closed loop of short
streams and a schedule of long prompts can share one run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import NamedTuple

import aiohttp
from tqdm import tqdm

from .client import Endpoint, RequestResult, send_request
from .datasets import RequestSpec


class RunResult(NamedTuple):
    results: list[RequestResult]  # in spec order
    duration_s: float


async def run(endpoint: Endpoint, specs: list[RequestSpec], offsets: list[float],
              decode: Callable[[list[int]], str], max_concurrency: int | dict[str, int] | None = None,
              progress: bool = True, desc: str = "requests", timeout_s: float = 600.0) -> RunResult:
    assert len(specs) == len(offsets), "one offset per spec"
    if isinstance(max_concurrency, dict):
        caps = {tag: asyncio.Semaphore(n) for tag, n in max_concurrency.items()}
    else:
        shared = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        caps = {s.tag: shared for s in specs} if shared else {}
    bar = tqdm(total=len(specs), desc=desc, unit="req", disable=not progress, dynamic_ncols=True)
    connector = aiohttp.TCPConnector(limit=0)  # the caps above decide concurrency
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()

        async def one(spec: RequestSpec, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            cap = caps.get(spec.tag)
            if cap is None:
                res = await send_request(session, endpoint, spec, t0, decode, timeout_s)
            else:
                async with cap:
                    res = await send_request(session, endpoint, spec, t0, decode, timeout_s)
            bar.update(1)
            if not res.ok:
                bar.set_postfix_str(f"last error: {res.error[:60]}")
            return res

        results = await asyncio.gather(*(one(s, o) for s, o in zip(specs, offsets)))
        duration = time.perf_counter() - t0
    bar.close()
    return RunResult(list(results), duration)
