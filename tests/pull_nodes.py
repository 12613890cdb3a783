"""Real nodes in the test's own process, for prefix-pull tests that hold or watch a node from
inside (tests/test_pull_aborts.py, tests/test_pull_budget.py): each node is its role's app
(HTTP server, engine thread, KV receiver and sender over tcp) on a free port, and the test
talks to it over HTTP as a router would."""

import asyncio
from contextlib import asynccontextmanager
from collections.abc import AsyncIterator

import aiohttp

from splitserve.common.config import EngineConfig, NodeConfig
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.protocol import GenerateRequest, PullSource
from splitserve.common.sampling_params import SamplingParams
from splitserve.decode_node.server import build_app
from splitserve.node.app import RUNTIME, start_site
from splitserve.router.streams.node_client import NodeClient
from splitserve.tests.metrics_text import sample_sum

BS = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@asynccontextmanager
async def decode_node(model, kv_cache_memory: int = 8 << 20, engine: dict | None = None,
                      **node) -> AsyncIterator[tuple]:
    """A decode node serving on a free port, in this process: (its app, its address).
    ``engine``: more EngineConfig fields; ``node``: more NodeConfig fields."""
    cfg = NodeConfig(role="decode", engine=EngineConfig(model=str(model), kv_cache_memory=kv_cache_memory,
                                                        block_size=BS, num_threads=1, **(engine or {})), **node)
    app = build_app(cfg)
    runner = await start_site(app, cfg)
    try:
        yield app, app[RUNTIME].http_addr
    finally:
        await runner.cleanup()


def client() -> aiohttp.ClientSession:
    """A connection per request: a node's handler may still be ending the last request on one
    (its AbortRequest queued behind a held engine thread) when the next is sent."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def until(pred, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.02)


async def generate(addr: str, rid: str, prompt: list[int], pull: PullSource | None = None,
                   params: SamplingParams = GREEDY) -> list[int]:
    """Run ``prompt`` on the decode node at ``addr`` (pulling ``pull`` first); its tokens."""
    async with client() as session:
        stream = await NodeClient(session).generate(addr, GenerateRequest(
            request_id=rid, prompt=WirePrompt.of(prompt), sampling_params=params, pull=pull))
        out: list[int] = []
        try:
            async for delta in stream.deltas():
                assert delta.error is None, delta.error
                out += delta.token_ids
        finally:
            stream.close()
        return out


async def metric(addr: str, name: str, **labels: str) -> float:
    async with client() as session, session.get(f"{addr}/metrics") as r:
        return sample_sum(await r.text(), name, **labels)


def pool_idle(app) -> bool:
    stats = app[RUNTIME].engine_thread.stats
    return stats.kv_blocks_free == stats.kv_blocks_total
