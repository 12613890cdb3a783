"""A prefix pull never leaks its reservation (node/kv_pull.py ``Puller``), on real nodes in this
process (the decode node's app with its engine thread, HTTP server and KV receiver, a tiny
random Llama): the request is cancelled while the pull's ``Reserve`` still waits for the engine
thread, or that ``Reserve`` fails after it allocated; either way the pool returns to its idle
free-block count, and a failed reservation costs the request nothing but the pull.

The engine thread is held between two steps by a real command (an ``ExportCached`` whose copy
waits on a gate, the way a pull's copy occupies it), so the ``Reserve`` is queued behind it
for as long as the test needs. End-to-end aborts with node processes (a pull cancelled in
flight, a puller killed mid-pull) are in tests/test_prefix_pull.py."""

import asyncio
import threading
from contextlib import asynccontextmanager

import aiohttp
import pytest

from splitserve.common import metric_names as names
from splitserve.common.config import EngineConfig, NodeConfig
from splitserve.common.hashing import token_bytes
from splitserve.common.protocol import GenerateRequest, PullSource
from splitserve.common.sampling_params import SamplingParams
from splitserve.decode_node.server import build_app
from splitserve.engine.engine_thread import CachedHashes, ExportCached
from splitserve.engine.kv.cache_manager import KVCacheManager
from splitserve.node.app import NODE, RUNTIME, start_site
from splitserve.router.streams.node_client import NodeClient
from splitserve.tests.metrics_text import sample_sum

BS = 16
PROMPT = [(37 * j + 11) % 30000 + 200 for j in range(10 * BS + 5)]
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(served_tiny_model):
    return served_tiny_model("llama", max_position_embeddings=2048)


@asynccontextmanager
async def decode_node(model):
    """A decode node serving on a free port, in this process: (its app, its address)."""
    cfg = NodeConfig(role="decode", engine=EngineConfig(model=str(model), kv_cache_memory=8 << 20,
                                                        block_size=BS, num_threads=1))
    app = build_app(cfg)
    runner = await start_site(app, cfg)
    try:
        yield app, app[RUNTIME].http_addr
    finally:
        await runner.cleanup()


async def until(pred, what: str, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.02)


async def generate(session, addr: str, rid: str, prompt: list[int], pull: PullSource | None) -> list[int]:
    stream = await NodeClient(session).generate(addr, GenerateRequest(
        request_id=rid, token_ids=token_bytes(prompt), sampling_params=PARAMS, pull=pull))
    out: list[int] = []
    try:
        async for delta in stream.deltas():
            assert delta.error is None, delta.error
            out += delta.token_ids
    finally:
        stream.close()
    return out


def client() -> aiohttp.ClientSession:
    """A connection per request: a node's handler may still be ending the last request on one
    (its AbortRequest queued behind the held engine thread) when the next is sent."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def pool_idle(app) -> bool:
    stats = app[RUNTIME].engine_thread.stats
    return stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.anyio
async def test_a_request_cancelled_while_its_pull_reserves_leaves_no_block_behind(model):
    async with decode_node(model) as (app, addr), client() as session:
        await generate(session, addr, "warm", PROMPT, None)  # the prefix is this node's cached blocks now
        await until(lambda: pool_idle(app), "idle after the first request")
        engine = app[RUNTIME].engine_thread
        inside, gate = threading.Event(), threading.Event()

        def held_copy(ids):  # the engine thread, between two steps, copying for a pull
            inside.set()
            gate.wait(60)
            return None

        held = engine.submit(ExportCached("held", PROMPT[:BS], None, None, 0, 1, held_copy))
        await until(inside.is_set, "the engine thread holds")
        source = PullSource(node_id="elsewhere", addr="http://127.0.0.1:9", tokens=10 * BS)
        request = asyncio.create_task(generate(session, addr, "r", PROMPT + [7], source))
        try:
            await until(lambda: app[NODE].puller.state()["reserving"] == 1, "the pull's Reserve is queued")
        finally:
            request.cancel()  # the client goes: the node's handler, its driver and the pull are cancelled
        await asyncio.gather(request, return_exceptions=True)
        await until(lambda: app[NODE].inflight() == 0 and app[NODE].puller.state()["reserving"] == 0,
                    "the node let the request go")
        gate.set()  # the Reserve runs now, after its awaiter is gone
        await held
        await engine.submit(CachedHashes())  # queued last: every command before it ran
        await until(lambda: pool_idle(app), "every block free again", timeout=10)


@pytest.mark.anyio
async def test_a_reserve_failing_after_it_allocated_frees_its_blocks_and_the_request_is_computed(
        model, monkeypatch):
    """Fault injection: the first ``before_write`` (the step of ``Reserve`` after its blocks are
    allocated) raises, as a lower tier's failing load would. The pull fails (counted), its blocks
    are freed, and the request computes its prompt: the client gets its tokens, not a stream
    that never ends."""
    async with decode_node(model) as (app, addr), client() as session:
        want = await generate(session, addr, "warm", PROMPT + [7], None)
        real, failed = KVCacheManager.before_write, []

        def failing(self):
            if not failed:
                failed.append(True)
                raise RuntimeError("injected: a lower tier failed to load")
            return real(self)

        monkeypatch.setattr(KVCacheManager, "before_write", failing)
        source = PullSource(node_id="elsewhere", addr="http://127.0.0.1:9", tokens=10 * BS)
        async with asyncio.timeout(30):
            got = await generate(session, addr, "r", PROMPT + [7], source)
        assert failed and got == want
        async with session.get(f"{addr}/metrics") as r:
            assert sample_sum(await r.text(), names.KV_PULLS, outcome="failed") == 1
        await until(lambda: pool_idle(app), "every block free again", timeout=10)
