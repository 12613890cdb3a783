"""A prefix pull never leaks its reservation (node/kv_pull.py ``Puller``), on real nodes in this
process (tests/pull_nodes.py: the decode node's app with its engine thread, HTTP server and KV
receiver, a tiny random Llama): the request is cancelled while the pull's ``Reserve`` still
waits for the engine thread, or that ``Reserve`` fails after it allocated; either way the pool
returns to its idle free-block count, and a failed reservation costs the request nothing but
the pull.

The engine thread is held between two steps by a real command (an ``ExportCached`` whose copy
waits on a gate, the way a pull's copy occupies it), so the ``Reserve`` is queued behind it
for as long as the test needs. End-to-end aborts with node processes (a pull cancelled in
flight, a puller killed mid-pull) are in tests/test_prefix_pull.py."""

import asyncio
import threading

import pytest

from splitserve.common import metric_names as names
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.protocol import PullSource
from splitserve.engine.engine_thread import CachedHashes, ExportCached
from splitserve.engine.kv.cache_manager import KVCacheManager
from splitserve.node.app import NODE, RUNTIME
from splitserve.node.prompt_hashes import read_prompt
from splitserve.tests.pull_nodes import BS, decode_node, generate, metric, pool_idle, until

PROMPT = [(37 * j + 11) % 30000 + 200 for j in range(10 * BS + 5)]
NOWHERE = PullSource(node_id="elsewhere", addr="http://127.0.0.1:9", tokens=10 * BS)  # never reached


@pytest.fixture(scope="module")
def model(served_tiny_model):
    return served_tiny_model("llama", max_position_embeddings=2048)


@pytest.mark.anyio
async def test_a_request_cancelled_while_its_pull_reserves_leaves_no_block_behind(model):
    async with decode_node(model) as (app, addr):
        await generate(addr, "warm", PROMPT)  # the prefix is this node's cached blocks now
        await until(lambda: pool_idle(app))
        engine = app[RUNTIME].engine_thread
        inside, gate = threading.Event(), threading.Event()

        def held_copy(ids):  # the engine thread, between two steps, copying for a pull
            inside.set()
            gate.wait(60)
            return None

        prefix = read_prompt(WirePrompt.of(PROMPT[:BS]), app[RUNTIME].config.engine)  # as a holder reads it
        held = engine.submit(ExportCached("held", prefix, start_block=0, max_blocks=1, pack=held_copy))
        await until(inside.is_set)
        request = asyncio.create_task(generate(addr, "r", PROMPT + [7], NOWHERE))
        try:
            await until(lambda: app[NODE].puller.state()["reserving"] == 1)  # the pull's Reserve is queued
        finally:
            request.cancel()  # the client goes: the node's handler, its driver and the pull are cancelled
        await asyncio.gather(request, return_exceptions=True)
        await until(lambda: app[NODE].inflight() == 0 and app[NODE].puller.state()["reserving"] == 0)
        gate.set()  # the Reserve runs now, after its awaiter is gone
        await held
        await engine.submit(CachedHashes())  # queued last: every command before it ran
        await until(lambda: pool_idle(app), timeout=10)


@pytest.mark.anyio
async def test_a_reserve_failing_after_it_allocated_frees_its_blocks_and_the_request_is_computed(
        model, monkeypatch):
    """Fault injection: the first ``before_write`` (the step of ``Reserve`` after its blocks are
    allocated) raises, as a lower tier's failing load would. The pull fails (counted), its blocks
    are freed, and the request computes its prompt: the client gets its tokens, not a stream
    that never ends."""
    async with decode_node(model) as (app, addr):
        want = await generate(addr, "warm", PROMPT + [7])
        real, failed = KVCacheManager.before_write, []

        def failing(self):
            if not failed:
                failed.append(True)
                raise RuntimeError("injected: a lower tier failed to load")
            return real(self)

        monkeypatch.setattr(KVCacheManager, "before_write", failing)
        async with asyncio.timeout(30):
            got = await generate(addr, "r", PROMPT + [7], NOWHERE)
        assert failed and got == want
        assert await metric(addr, names.KV_PULLS, outcome="failed") == 1
        await until(lambda: pool_idle(app), timeout=10)
