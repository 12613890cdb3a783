"""Tier-aware routing on real processes (redis-server, the router, one prefill and one
decode node over tcp, a tiny random Llama with a 12-block KV cache and a 16-block host
tier): prompts that push an earlier one out of the prefill node's device leave its
blocks in host memory, the index says so (the node's events -> Redis -> the router's
mirror), and when that prompt comes back /debug/decisions shows the predicted hit split
by tier with blocks in host memory, the router counts predicted host tokens, and the
node delivers what was predicted."""

import json
import os
import time
import urllib.request

import openai
import pytest

from splitserve.deploy.launcher import Cluster, TierFlags
from tests.metrics_text import sample_sum

pytestmark = pytest.mark.slow
os.environ.setdefault("SPLITSERVE_QUIET", "1")
BS = 16
BLOCK = 2 * 2 * BS * 2 * 16 * 4  # a tiny Llama block: 2 layers, K and V, 16 tokens, 2 KV heads of 16, fp32


def prompts() -> list[list[int]]:
    """Three unrelated prompts of 7 full blocks: each pushes the one before off a 12-block cache."""
    return [[(31 * i + 7 * j + 3) % 40000 + 100 for j in range(7 * BS + 8)] for i in range(3)]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_a_prompt_back_from_host_memory_is_predicted_there(served_tiny_model):
    model = served_tiny_model("llama", max_position_embeddings=512)
    tiers = TierFlags(memory=str(16 * BLOCK), dir=None, disk_bytes=None)
    # the prefill node's tiers are the subject: the decode node (which holds the prompts too)
    # neither prefills them itself nor is pulled from
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory=str(12 * BLOCK),
                 model=str(model), kv_offload=tiers,
                 router_args=["--score-weights", "local_prefill_tokens=0", "--no-prefix-pull"]) as c:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=60)

        def ask(i: int) -> dict:
            client.completions.create(model=str(model), prompt=prompts()[i], max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
            return json.loads(get(f"{c.url}/debug/decisions?limit=1"))["decisions"][-1]

        for i in range(3):
            ask(i)
        deadline = time.monotonic() + 30
        while True:  # the evictions' events reach the router's mirror within a flush or two
            d = ask(0)
            split = d["predicted_hit_blocks_by_tier"]
            if split["host"] or time.monotonic() > deadline:
                break
            for i in (1, 2):  # push prompt 0 out again
                ask(i)
        assert d["prefill"] == "prefill-0" and split["host"] > 0, d
        assert sum(split.values()) * BS == d["predicted_cached_tokens"] == d["node_cached_tokens"]["prefill-0"]
        while d["outcome"] is None and time.monotonic() < deadline + 10:  # settled as the stream closes
            time.sleep(0.05)
            d = json.loads(get(f"{c.url}/debug/decisions?limit=1"))["decisions"][-1]
        assert d["outcome"] == "hit" and d["delivered_cached_tokens"] >= d["predicted_cached_tokens"], d
        metrics = get(f"{c.url}/metrics")
        assert sample_sum(metrics, "splitserve:routing_predicted_cached_tokens_total", tier="host") > 0
        assert sample_sum(metrics, "splitserve:routing_predicted_cached_tokens_total", tier="disk") == 0
