"""A prefill node refuses a prompt it cannot start now (its queue or its KV pool is
full) instead of accepting it and letting the decode node's lease run out. A real
engine on its EngineThread thread and the real PrefillNode; the refusal reads only the
load snapshot the engine thread publishes."""

import asyncio

import pytest

from splitserve.common.config import EngineConfig, NodeConfig
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_thread import AbortRequest, AddRequest
from splitserve.node.prompt_hashes import read_prompt
from splitserve.node.runtime import NodeRuntime
from splitserve.prefill_node.server import PrefillNode


async def settle(rt: NodeRuntime, pred, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred(rt.engine_thread.load):
        assert asyncio.get_running_loop().time() < deadline, rt.engine_thread.load
        await asyncio.sleep(0.02)


@pytest.mark.anyio
async def test_refuses_when_the_queue_or_the_pool_is_full(bundled_dir):
    cfg = NodeConfig(role="prefill", engine=EngineConfig(model=str(bundled_dir), kv_cache_memory=16 << 20,
                                                         max_num_seqs=1, num_threads=1))
    rt = NodeRuntime(cfg)
    await rt.start_engine(shm=False)
    node = PrefillNode(cfg, rt)
    await node.start()
    rt.start_loop(node.on_deltas, node.exporter)
    try:
        total = rt.engine_thread.stats.kv_blocks_total
        prompt = lambda ids: read_prompt(WirePrompt.of(ids), cfg.engine)  # noqa: E731  (as the node reads one)
        assert node._refusal(20) is None  # idle
        long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        await rt.engine_thread.submit(AddRequest("a", prompt(range(1, 16 * (total - 8))), params=long))  # most of the pool
        await settle(rt, lambda load: load.running == 1 and load.queued_prefill_tokens == 0)
        assert "KV pool full" in node._refusal(16 * 10)  # 10 blocks, at most 8 free
        assert node._refusal(20) is None
        await rt.engine_thread.submit(AddRequest("b", prompt(range(1, 20)), params=long))  # max_num_seqs=1: it waits
        await settle(rt, lambda load: load.waiting == 1)
        assert "wait here" in node._refusal(20)
        for rid in ("a", "b"):
            assert await rt.engine_thread.submit(AbortRequest(rid))
        await settle(rt, lambda load: load.running == load.waiting == 0)
        assert node._refusal(16 * 10) is None
        assert rt.engine_thread.stats.kv_blocks_free == total
    finally:
        await node.stop()
        rt.shutdown()
