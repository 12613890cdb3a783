"""KV tiers on real nodes: router -> prefill -> decode processes (redis-server, the router,
one prefill and one decode node, tcp), a tiny random Llama over the bundled tokenizer, KV
caches of a few prompts' blocks, a host tier and a disk tier on every node (`up`'s
TierFlags: each node its own folder).

Four prompts of 7 blocks each go through once (each pushes the one before out of the
device and, past the small host tier, onto disk), then again in reverse order: the second
round is served from the prefill node's device, host and disk tiers (its metrics count
hits in both lower tiers), and every
text equals the engine's greedy text with no prefix cache at all (recomputed). The
heartbeat reports each tier (NodeInfo.tiers) and every pool is free afterwards.
"""

import asyncio
import os
import signal
import time
import urllib.request

import openai
import pytest

from splitserve.benchmarks.harness import wait_pools_free
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.launcher import Cluster, TierFlags
from splitserve.engine.kv.disk_trust import KEY_FILE_NAME
from splitserve.common.node_registry import NodeRegistry
from tests.metrics_text import sample_sum

pytestmark = pytest.mark.slow
os.environ.setdefault("SPLITSERVE_QUIET", "1")
BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # a tiny Llama block: 2 layers, K and V, 16 tokens, 2 KV heads of 16, fp32
MAX_TOKENS = 8

# the prefill node's tiers are the subject: the decode node holds the prompts too, and would
# prefill them itself or be pulled from
PREFILL_NODE_ONLY = ["--score-weights", "local_prefill_tokens=0", "--no-prefix-pull"]


def prompts() -> list[list[int]]:
    return [[(31 * i + 7 * j + 3) % 40000 + 100 for j in range(120)] for i in range(4)]


def reference(model_dir) -> list[str]:
    from splitserve.engine.llm import LLM
    with LLM(str(model_dir), kv_cache_memory=64 * BLOCK, enable_prefix_caching=False) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return [o.text for o in llm.generate(prompts(), params)]


def scrape(addr: str) -> str:
    with urllib.request.urlopen(f"{addr}/metrics", timeout=10) as r:
        return r.read().decode()


def test_blocks_from_host_and_disk_give_the_recomputed_tokens(served_tiny_model, tmp_path):
    model = served_tiny_model("llama", max_position_embeddings=512)
    want = reference(model)
    tiers = TierFlags(memory=str(4 * BLOCK), dir=str(tmp_path / "kv"), disk_bytes="4MiB")
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory=str(12 * BLOCK),
                 model=str(model), kv_offload=tiers, router_args=PREFILL_NODE_ONLY) as c:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=60)
        order = [0, 1, 2, 3, 3, 2, 1, 0]  # back in reverse: the device, then host memory, then disk
        got = []
        for i in order:
            r = client.completions.create(model=str(model), prompt=prompts()[i], max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
            got.append(r.choices[0].text)
        assert got == [want[i] for i in order]
        prefill, decode = c.node("prefill-0").addr, c.node("decode-0").addr
        text = scrape(prefill)
        host_hits = sample_sum(text, "splitserve:kv_offload_hits_total", tier="host")
        disk_hits = sample_sum(text, "splitserve:kv_offload_hits_total", tier="disk")
        assert host_hits > 0 and disk_hits > 0, (host_hits, disk_hits)
        assert sample_sum(text, "splitserve:kv_offload_bytes_total", tier="host", direction="store") > 0
        assert sample_sum(text, "splitserve:kv_offload_faults_total", tier="disk", fault="corrupt") == 0
        assert any(p.suffix == ".kvb" for p in (tmp_path / "kv" / "prefill-0").rglob("*"))
        asyncio.run(wait_pools_free([prefill, decode], {}, 10))
        deadline = time.monotonic() + 15  # the heartbeat after the last load carries its rate
        while True:
            nodes = asyncio.run(registered(c.redis_url))
            if nodes["prefill-0"].tiers[1].load_bytes_per_s > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    for node in ("prefill-0", "decode-0"):  # the heartbeat reports each tier: device, host, disk
        assert [t.tier.name for t in nodes[node].tiers] == ["DEVICE", "HOST", "DISK"]
    host = nodes["prefill-0"].tiers[1]
    assert host.capacity_blocks == 4 and 0 < host.used_blocks <= 4 and host.load_bytes_per_s > 0


async def registered(redis_url: str) -> dict:
    registry = NodeRegistry(redis_url)
    try:
        return {n.node_id: n for n in await registry.list_nodes()}
    finally:
        await registry.close()


def test_a_node_killed_while_storing_comes_back_with_its_disk_tier(served_tiny_model, tmp_path):
    """kill -9 of the prefill node while its disk writer stores blocks (prompts stream
    through a host tier of 2 blocks, so nearly every eviction is a disk write): the
    supervisor restarts it on the same folder, it starts (no temporary is left, no
    file under a block's name is half-written), later requests get the recomputed texts,
    some from the files the killed node wrote (under the key it made and finds again), and
    no disk file fails its checks."""
    model = served_tiny_model("llama", max_position_embeddings=512)
    want = reference(model)
    folder = tmp_path / "kv"
    tiers = TierFlags(memory=str(2 * BLOCK), dir=str(folder), disk_bytes="4MiB")
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory=str(12 * BLOCK),
                 model=str(model), kv_offload=tiers, router_args=PREFILL_NODE_ONLY) as c:
        c.supervise()
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=2, timeout=60)

        def ask(i: int) -> str:
            return client.completions.create(model=str(model), prompt=prompts()[i], max_tokens=MAX_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True}).choices[0].text
        assert [ask(i) for i in range(4)] == want
        old = c.node("prefill-0").popen.pid
        os.kill(old, signal.SIGKILL)  # its writer is storing the blocks the last prompts pushed out
        deadline = time.monotonic() + 60
        while not (c.node("prefill-0").popen.pid != old and c.node("prefill-0").ready.is_set()):
            assert time.monotonic() < deadline, "the prefill node did not come back"
            time.sleep(0.2)
        c.wait_for_nodes(2, 30)
        assert not [p for p in (folder / "prefill-0").rglob("*")
                    if p.is_file() and p.suffix != ".kvb" and p.name != KEY_FILE_NAME]
        assert [ask(i) for i in (0, 1, 2, 3)] == want
        text = scrape(c.node("prefill-0").addr)
        assert sample_sum(text, "splitserve:kv_offload_hits_total", tier="disk") > 0  # the killed node's files
        assert sample_sum(text, "splitserve:kv_offload_faults_total", tier="disk", fault="corrupt") == 0
        # the restarted node reads its files under the key it made before (DIR/kv-disk.key)
        assert sample_sum(text, "splitserve:kv_offload_faults_total", tier="disk", fault="unauthenticated") == 0
        asyncio.run(wait_pools_free([c.node("prefill-0").addr, c.node("decode-0").addr], {}, 10))
