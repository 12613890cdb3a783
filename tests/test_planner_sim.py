"""Scaling through the planner's local actuator loses nothing, on simulated nodes (one
process each, as ``up`` runs real ones): a decode node drained while it streams finishes
every stream, refuses new work (the router sends it elsewhere), leaves the node registry
and withdraws its prefix-index entries, and exits 0; a node started joins the traffic."""

import asyncio
import os
import time

import aiohttp
import pytest
import redis

from splitserve.common.kv_index import blocks_key
from splitserve.common.node_registry import NodeRegistry
from splitserve.deploy.launcher import SimCluster
from splitserve.deploy.planner.actuator import LocalPools

pytestmark = pytest.mark.slow
os.environ.setdefault("SPLITSERVE_QUIET", "1")
MODEL = "SmolLM2-135M-Instruct"


async def stream(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> int:
    """Output tokens of one streamed completion (raises on any failure)."""
    body = {"model": MODEL, "prompt": [1000 + 7 * i + k for k in range(40)], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        text = await r.text()
    assert "data: [DONE]" in text and '"error"' not in text, text[-300:]
    import json
    usage = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {") and '"usage"' in line]
    return usage[-1]["usage"]["completion_tokens"]


async def nodes(redis_url: str):
    reg = NodeRegistry(redis_url)
    try:
        return await reg.list_nodes()
    finally:
        await reg.close()


def test_a_decode_node_drained_mid_stream_finishes_its_streams_and_a_started_node_serves():
    # speedup 4: a decode step of the CPU fit takes ~25-40 ms, so 150 tokens stream for ~4-6 s
    with SimCluster(1, 2, per_node=True, sim_args=["--sim-speedup", "4", "--drain-grace", "60"],
                    kv_cache_memory="256MiB") as cluster:
        pools = LocalPools(cluster)
        assert pools.counts([]) == {"prefill": 1, "decode": 2}

        async def scenario():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                first = [asyncio.create_task(stream(s, cluster.url, i, 150)) for i in range(8)]
                deadline = time.monotonic() + 4
                while True:  # every stream runs on one decode node or the other (as their heartbeats say)
                    before = await nodes(cluster.redis_url)
                    if all(n.load.running for n in before if n.role == "decode"):
                        break
                    assert time.monotonic() < deadline, before
                    await asyncio.sleep(0.2)
                did = await pools.apply({"decode": -1}, before)
                victim = next(n for n in before if did[0].startswith(f"draining {n.node_id.split('-decode-')[0]}"))
                # new work keeps coming while the node drains
                more = [asyncio.create_task(stream(s, cluster.url, 100 + i, 10)) for i in range(6)]
                return victim, await asyncio.gather(*first), await asyncio.gather(*more)

        victim, first, more = asyncio.run(scenario())
        assert first == [150] * 8 and more == [10] * 6
        proc = cluster.node(victim.node_id.split("-decode-")[0])
        assert proc.popen.wait(30) == 0  # drained and exited on its own
        pools.poll()
        assert pools.counts([]) == {"prefill": 1, "decode": 1}
        left = asyncio.run(nodes(cluster.redis_url))
        assert victim.node_id not in {n.node_id for n in left}
        with redis.Redis.from_url(cluster.redis_url) as r:
            assert not r.exists(blocks_key(victim.node_id, victim.epoch))  # its index entries withdrawn
        assert victim.node_id.split("-decode-")[0] in cluster.retired  # never restarted

        # a node started by the actuator registers and takes requests
        asyncio.run(pools.apply({"decode": 1}, left))
        deadline = time.monotonic() + 60
        while sum(n.role == "decode" for n in asyncio.run(nodes(cluster.redis_url))) < 2:
            assert time.monotonic() < deadline, "the started decode node did not register"
            time.sleep(0.5)

        async def spread():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                return await asyncio.gather(*(stream(s, cluster.url, 200 + i, 20) for i in range(8)))
        assert asyncio.run(spread()) == [20] * 8
        busy = {n.node_id for n in asyncio.run(nodes(cluster.redis_url)) if n.role == "decode"}
        assert len(busy) == 2
        assert pools.device_seconds()["decode"] > 0
