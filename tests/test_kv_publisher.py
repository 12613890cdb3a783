"""A real engine on its EngineThread thread publishing to a real redis-server through
KVEventPublisher: the index follows the prefix cache through stores, evictions and a
reset, holds the router's hashes of the prompt, survives a Redis restart by
rewriting the full state, and is dropped on stop."""

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, Counter

from splitserve.common.hashing import hash_blocks
from splitserve.common.kv_index import KVIndex
from splitserve.common.node_registry import new_epoch
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.launcher import free_port, start_redis
from splitserve.engine.engine_thread import AddRequest, CachedHashes, EngineThread, ResetPrefixCache
from splitserve.node.kv_publisher import KVEventPublisher

pytestmark = pytest.mark.anyio

BS = 16
BLOCK_BYTES = 737280  # one 16-token block of the bundled model in fp32


@pytest.fixture
def redis_port():
    """A redis-server the test may kill and start again on the same port."""
    port = free_port()
    procs = [start_redis(port)[0]]
    yield port, procs
    for p in procs:
        p.kill()
        p.wait()


class Harness:
    """EngineThread + publisher, as NodeRuntime wires them, without HTTP."""

    def __init__(self, engine, url: str):
        self.engine = engine
        self.done: dict[str, asyncio.Future] = {}
        self.engine_thread = EngineThread(engine, asyncio.get_running_loop(), self._on_deltas,
                               lambda ev, snap: self.pub.on_kv(ev, snap))
        self.batches = Counter("b", "b", ["result"], registry=CollectorRegistry())
        self.index = KVIndex(url, ttl_s=30.0, timeout_s=0.2)
        self.epoch = new_epoch()
        self.pub = KVEventPublisher(self.index, "n0", self.epoch, self.engine_thread.request_kv_snapshot,
                                    self.batches, refresh_interval_s=0.3)

    def _on_deltas(self, deltas):
        for d in deltas:
            if d.finish_reason is not None and d.request_id in self.done:
                self.done.pop(d.request_id).set_result(d.finish_reason)

    async def generate(self, rid: str, ids: list[int], n: int = 4) -> None:
        fut = self.done[rid] = asyncio.get_running_loop().create_future()
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        await self.engine_thread.submit(AddRequest(rid, self.engine.prompt_ref(ids), params=params))
        await asyncio.wait_for(fut, 60)

    async def cached(self) -> set[int]:
        return set(await self.engine_thread.submit(CachedHashes()))

    async def wait_index_equals_cache(self, timeout=10.0) -> set[int]:
        deadline = time.monotonic() + timeout
        while True:
            want = await self.cached()
            try:
                got = await self.index.members("n0", self.epoch)
            except OSError:
                got = None
            if got == want:
                return got
            assert time.monotonic() < deadline, f"index {got} != cache {want}"
            await asyncio.sleep(0.05)


def prompt(tokenizer, topic: str) -> list[int]:
    return tokenizer(f"Write a detailed paragraph about {topic}, covering their history, the science "
                     f"behind {topic}, and the culture around {topic}, with examples from many "
                     f"countries and centuries, quoting at least two experts on {topic}.")["input_ids"]


async def test_index_follows_the_prefix_cache(make_engine, tokenizer, redis_port):
    port, procs = redis_port
    engine = make_engine(block_size=BS, kv_cache_memory=10 * BLOCK_BYTES, num_threads=1)
    h = Harness(engine, f"redis://127.0.0.1:{port}/0")
    h.engine_thread.start()
    h.pub.start()
    try:
        ids = prompt(tokenizer, "apples")
        assert len(ids) >= 2 * BS
        await h.generate("a", ids)
        held = await h.wait_index_equals_cache()
        # the router's hashes of the prompt (same model id extra key and block size)
        router_hashes = hash_blocks(ids, BS, (engine.config.model_id,))
        assert router_hashes and set(router_hashes) <= held
        assert h.pub.in_sync and h.pub.seq >= 1

        # other prompts evict the first: removals reach the index too
        for i, topic in enumerate(["rivers", "volcanoes", "glaciers"]):
            await h.generate(f"b{i}", prompt(tokenizer, topic))
        held = await h.wait_index_equals_cache()
        assert not set(router_hashes) <= held

        # Redis restarts empty mid-run: the publisher notices and rewrites its full state
        snapshots = h.pub.snapshots  # read before the outage: the resync may finish as Redis starts
        procs[0].kill()
        procs[0].wait()
        await h.generate("c", prompt(tokenizer, "chess"))  # published into the void
        await asyncio.sleep(0.5)
        procs.append(start_redis(port)[0])
        await h.wait_index_equals_cache()
        assert h.pub.snapshots > snapshots
        assert h.batches.labels("error")._value.get() >= 1

        # a prefix-cache reset (AllBlocksCleared) wipes the node's entries
        assert await h.engine_thread.submit(ResetPrefixCache())
        assert await h.wait_index_equals_cache() == set()
        await h.generate("d", ids)
        assert set(router_hashes) <= await h.wait_index_equals_cache()
    finally:
        await h.pub.stop()  # drops the entries
        assert await h.index.members("n0", h.epoch) == set()
        assert await h.index.last_seq("n0", h.epoch) is None
        h.engine_thread.stop()
        await h.index.close()
