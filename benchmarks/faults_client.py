"""The client side of the fault suite (tests/test_faults.py) and benchmark
(benchmarks/bench_faults.py): streamed OpenAI requests that may hang up at a chosen
point, open-loop load at a fixed rate, and the checks of a cluster's aftermath (every
KV pool free, no /dev/shm segment left).

Owns: ``Disconnect`` points, ``Outcome`` and ``RequestResult``, ``stream_request``,
``run_load``, ``wait_pools_free``. Must not start or kill processes (the caller's
``deploy.launcher.Cluster`` does).
"""

from __future__ import annotations

import asyncio
import enum
import json
import random
import time
from typing import NamedTuple

import aiohttp

MODEL = "SmolLM2-135M-Instruct"


class Disconnect(enum.Enum):
    NONE = "none"  # read the stream to its end
    BEFORE_FIRST_BYTE = "before_first_byte"  # hang up before the response headers
    AFTER_ROLE = "after_role"  # chat: hang up right after the role-only first chunk
    MID_STREAM = "mid_stream"  # hang up after a few content chunks


class Outcome(enum.Enum):
    OK = "ok"  # streamed to [DONE] without an error event
    FAILED = "failed"  # an HTTP error, an error event, or a stream cut short
    DISCONNECTED = "disconnected"  # the client hung up on purpose


class RequestResult(NamedTuple):
    outcome: Outcome
    started: float  # time.monotonic() at send
    ended: float  # when the outcome was known
    text: str
    error: str | None
    longest_gap_s: float = 0.0  # longest silence between two events of the stream (a stall)


async def stream_request(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                         disconnect: Disconnect = Disconnect.NONE, mid_chunks: int = 2,
                         timeout_s: float = 120.0) -> RequestResult:
    """One streamed chat completion through the router at ``url`` (greedy)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    t0 = time.monotonic()
    text, chunks = [], 0
    t_last, gap = None, 0.0  # time of the last event, the longest silence between two
    if disconnect is Disconnect.BEFORE_FIRST_BYTE:
        task = asyncio.ensure_future(session.post(f"{url}/v1/chat/completions", json=body))
        await asyncio.sleep(random.uniform(0.0, 0.05))
        task.cancel()
        try:
            resp = await task
            resp.close()  # the headers came first: hang up now
        except (asyncio.CancelledError, aiohttp.ClientError):
            pass
        return RequestResult(Outcome.DISCONNECTED, t0, time.monotonic(), "", None)
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    return RequestResult(Outcome.FAILED, t0, time.monotonic(), "",
                                         f"HTTP {resp.status}: {(await resp.text())[:200]}")
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    now = time.monotonic()
                    if t_last is not None:
                        gap = max(gap, now - t_last)
                    t_last = now
                    if data == b"[DONE]":
                        return RequestResult(Outcome.OK, t0, now, "".join(text), None, gap)
                    event = json.loads(data)
                    if "error" in event:
                        return RequestResult(Outcome.FAILED, t0, time.monotonic(), "".join(text),
                                             str(event["error"])[:200])
                    chunks += 1
                    for choice in event.get("choices", []):
                        text.append(choice.get("delta", {}).get("content") or "")
                    if (disconnect is Disconnect.AFTER_ROLE and chunks == 1) or \
                            (disconnect is Disconnect.MID_STREAM and chunks == 1 + mid_chunks):
                        resp.close()
                        return RequestResult(Outcome.DISCONNECTED, t0, time.monotonic(), "".join(text), None)
        return RequestResult(Outcome.FAILED, t0, time.monotonic(), "".join(text), "stream ended without [DONE]")
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return RequestResult(Outcome.FAILED, t0, time.monotonic(), "".join(text), repr(e)[:200])


async def run_load(url: str, rate: float, duration_s: float, prompts: list[str], max_tokens: int,
                   disconnect_fraction: float = 0.0, seed: int = 0, count: int | None = None) -> list[RequestResult]:
    """Open-loop load: a request every 1/rate s for ``duration_s`` (or exactly ``count``
    requests); a ``disconnect_fraction`` of them hang up at a random point. Returns every result."""
    rng = random.Random(seed)
    points = [Disconnect.BEFORE_FIRST_BYTE, Disconnect.AFTER_ROLE, Disconnect.MID_STREAM]
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.monotonic()
        i = 0
        while (i < count) if count is not None else (time.monotonic() < t0 + duration_s):
            d = rng.choice(points) if rng.random() < disconnect_fraction else Disconnect.NONE
            tasks.append(asyncio.create_task(stream_request(
                session, url, prompts[i % len(prompts)], max_tokens, d, mid_chunks=rng.randint(1, 4))))
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))  # no drift
        return list(await asyncio.gather(*tasks))


async def node_state(session: aiohttp.ClientSession, addr: str, headers: dict) -> dict:
    async with session.get(f"{addr}/debug/state", headers=headers,
                           timeout=aiohttp.ClientTimeout(total=10)) as r:
        r.raise_for_status()
        return await r.json()


async def wait_pools_free(addrs: list[str], headers: dict, timeout_s: float) -> tuple[float, dict]:
    """Poll every node's /debug/state until each pool is 100% free with no stream or
    transfer left; (seconds it took, last states). Raises TimeoutError with the states."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while True:
            states = {a: await node_state(session, a, headers) for a in addrs}
            if all(s["kv_blocks_free"] == s["kv_blocks_total"] and not s.get("streams") and not s.get("transfers")
                   and not s.get("outgoing") for s in states.values()):
                return time.monotonic() - t0, states
            if time.monotonic() - t0 > timeout_s:
                brief = {a: {k: s.get(k) for k in ("kv_blocks_free", "kv_blocks_total", "streams", "outgoing",
                                                  "transfers")} for a, s in states.items()}
                raise TimeoutError(f"pools not free after {timeout_s}s: {brief}")
            await asyncio.sleep(0.2)
