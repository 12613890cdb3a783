"""The modelled KV network of a simulated prefill node (node/sim_link.py): a transfer's
blocks arrive when the link would have carried them, behind the node's earlier transfers,
and a real move slower than the model is counted, not hidden."""

import asyncio
import time

import pytest

from splitserve.common.config import SimConfig
from splitserve.node.sim_link import SimLink

# 1 MiB blocks (64 KiB per token x 16) over 1 GB/s: ~1.05 ms per block, at 2x speed-up half that
SIM = SimConfig(kv_bytes_per_token=65536, kv_network_bytes_per_s=1e9, kv_network_latency_s=0.004, speedup=2.0)


def test_blocks_queue_behind_the_links_earlier_transfers():
    link = SimLink(SIM, 16)
    assert link.block_s == pytest.approx(16 * 65536 / 1e9 / 2) and link.latency_s == 0.002
    t0 = time.monotonic()
    first = link.book(20)  # ~10.5 ms of link
    second = link.book(10)  # starts when the first has left
    assert first - t0 == pytest.approx(20 * link.block_s + 0.002, abs=0.002)
    assert second - first == pytest.approx(10 * link.block_s, abs=1e-6)
    time.sleep(0.05)  # an idle link: the next batch starts now, not behind the old ones
    third = link.book(4)
    assert third - time.monotonic() == pytest.approx(4 * link.block_s + 0.002, abs=0.002)
    assert link.blocks == 34


def test_an_answer_waits_for_the_modelled_arrival_and_a_late_real_move_is_counted():
    async def main():
        link = SimLink(SIM, 16)
        due = link.book(40)  # ~21 ms + 2 ms latency
        t0 = time.monotonic()
        await link.arrive(due)
        waited = time.monotonic() - t0
        assert waited == pytest.approx(40 * link.block_s + 0.002, abs=0.006)
        assert (link.transfers, link.late) == (1, 0)
        due = link.book(1)
        await asyncio.sleep(0.03)  # the real move took longer than the model
        await link.arrive(due)
        st = link.state()
        assert (st["transfers"], st["late"]) == (2, 1) and 0.02 < st["late_s"] == st["max_late_s"] < 0.06

    asyncio.run(main())


@pytest.mark.slow
def test_a_simulated_prefill_node_answers_when_its_blocks_would_have_crossed_the_network():
    """Real processes (redis-server, the router, a fleet of one prefill and one decode node
    standing for llama3-8b-h100), slowed down 4x so the modelled move (500 blocks of 2 MiB at
    50 GB/s: 21 ms) stands out of this machine's own: the first token comes after the prompt's
    compute plus the move, the prefill node counts the transfer and its blocks, none late."""
    import json
    import os
    import urllib.request

    import openai

    from splitserve.deploy.planner.sim_profiles import get_profile
    from splitserve.deploy.launcher import SimCluster

    os.environ.setdefault("SPLITSERVE_QUIET", "1")
    p, speedup, n = get_profile("llama3-8b-h100"), 0.25, 8000
    with SimCluster(1, 1, fleet_procs=1, sim_args=["--sim-speedup", str(speedup), "--profile", p.name],
                    router_args=["--max-model-len", str(p.context), "--allow-long-max-model-len"]) as c:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="-", max_retries=0)
        t0 = time.perf_counter()
        stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=list(range(1000, 1000 + n)),
                                           max_tokens=2, stream=True)
        ttft = None
        for chunk in stream:
            if ttft is None and chunk.choices:
                ttft = time.perf_counter() - t0
        with urllib.request.urlopen(f"{c.url}/health", timeout=10) as r:
            assert json.loads(r.read())["prefill_nodes"] == 1
        states = asyncio.run(_states(c.redis_url))
    link = states["prefill"]["sim_link"]
    blocks = -(-n // 16)
    assert (link["transfers"], link["blocks"], link["late"]) == (1, blocks, 0)
    sim = p.sim_config()
    modelled = (p.prefill_seconds(n) + sim.transfer_seconds(blocks, 16) + sim.kv_network_latency_s) / speedup
    assert modelled <= ttft < modelled + 0.5, (ttft, modelled)  # the move is waited for, nothing else much


async def _states(redis_url: str) -> dict[str, dict]:
    from splitserve.benchmarks.loadgen.replay.run import node_states

    return {st["role"]: st for st in (await node_states(redis_url)).values()}
