"""A new hash key is one edit, for every role: a real redis-server, a prefill node and a
decode node (real processes) behind an in-process router whose one place that builds a
request's keys (router/prompt.py ``prompt_keys``) the test patches to add ("adapter", "x").
Nothing else changes, yet both nodes cache and publish the prompt's blocks under the hashes
with that key (none under the default ones), adopt the router's hashes (they agree on
them), and the cluster serves the engine's greedy tokens exactly."""

import asyncio
import json
import time
import urllib.request

import aiohttp
import pytest
import redis

from splitserve.common import metric_names as names
from splitserve.common.hashing import hash_blocks
from splitserve.common.kv_index import blocks_key
from splitserve.common.prompt_ref import PromptKeys
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.launcher import Cluster
from splitserve.engine.llm import LLM
from splitserve.router import prompt as router_prompt
from splitserve.router.app import start_router
from splitserve.router.config import RouterConfig
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.tests.metrics_text import node_metric

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

BS = 16
PROMPT = [(37 * j + 11) % 20000 + 100 for j in range(6 * BS + 5)]  # 6 full blocks
NEW_TOKENS = 12
NODES = ("prefill-0", "decode-0")


@pytest.fixture(scope="module")
def model(served_tiny_model):
    return served_tiny_model("llama", max_position_embeddings=512)


@pytest.fixture(scope="module")
def nodes(model):
    """Redis, one prefill node and one decode node, each a real process; no router."""
    c = Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory="8MiB", model=str(model))
    try:
        c.start_redis()
        for p in [c.start_node("prefill", 0), c.start_node("decode", 0)]:
            c.wait_ready(p, 180)
        yield c
    finally:
        c.stop()


def held(c: Cluster, name: str) -> set[int]:
    """The block hashes node ``name`` holds in the prefix index, as Redis has them."""
    with urllib.request.urlopen(f"{c.node(name).addr}/debug/state", timeout=10) as r:
        epoch = json.loads(r.read())["epoch"]
    with redis.Redis.from_url(c.redis_url, socket_timeout=2) as r:
        return {int(m) for m in r.smembers(blocks_key(name, epoch))}


async def test_a_key_added_in_the_one_place_reaches_every_role_and_serves_token_exact(nodes, model, monkeypatch):
    made: list[PromptKeys] = []  # what the router built, to recompute the hashes independently

    def with_adapter(model_id: str, cache_salt: str | None) -> PromptKeys:
        keys = PromptKeys(model=model_id, cache_salt=cache_salt, extra=(("adapter", "x"),))
        made.append(keys)
        return keys

    monkeypatch.setattr(router_prompt, "prompt_keys", with_adapter)  # the one edit
    with LLM(str(model), kv_cache_memory=8 << 20) as llm:  # the engine's greedy tokens, offline
        ref = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))[0].token_ids
    tok = RouterTokenizer(model)
    router = await start_router(RouterConfig(host="127.0.0.1", port=0, redis_url=nodes.redis_url, model=str(model),
                                             poll_interval_s=0.05))
    try:
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 30
            while True:  # the router sees both nodes
                async with s.get(f"{router.url}/health") as r:
                    h = await r.json()
                if h.get("prefill_nodes", 0) >= 1 and h.get("decode_nodes", 0) >= 1:
                    break
                assert time.monotonic() < deadline, h
                await asyncio.sleep(0.1)
            body = {"model": str(model), "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0}
            async with s.post(f"{router.url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                out = await r.json()
    finally:
        await router.stop()

    assert out["choices"][0]["logprobs"]["tokens"] == [tok.token_text(t) for t in ref]  # token-exact
    assert out["usage"]["completion_tokens"] == len(ref)
    assert made and all(k.extra == (("adapter", "x"),) for k in made)
    keyed = hash_blocks(PROMPT, BS, made[0].hash_keys())
    default = hash_blocks(PROMPT, BS, PromptKeys(model=made[0].model).hash_keys())
    assert len(keyed) == 6 and not set(keyed) & set(default)
    for name in NODES:  # each node cached and published the blocks under the keyed hashes, none under the default
        deadline = time.monotonic() + 15
        while not set(keyed) <= held(nodes, name):
            assert time.monotonic() < deadline, f"{name} never published the keyed hashes"
            await asyncio.sleep(0.05)
        assert not set(default) & held(nodes, name)
        # the router's hashes with the key checked out on the node: every role hashes alike
        assert node_metric(nodes, name, names.PROMPT_HASHES, result="adopted") >= 1
        assert node_metric(nodes, name, names.PROMPT_HASHES, result="rehashed") == 0
    assert node_metric(nodes, "prefill-0", names.KV_BLOCKS_SENT) > 0  # disaggregated: the KV moved
    assert node_metric(nodes, "decode-0", names.FALLBACK_PREFILLS) == 0
