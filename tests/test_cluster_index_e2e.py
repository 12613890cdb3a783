"""End to end, the prefix index and cache-aware routing: a real redis-server (one
this module can kill and restart), two prefill nodes, a decode node and the router,
each a real process, driven through the official openai client.

The tests run in order on one cluster: hashes agree; a repeated prefix follows its
node; a stale entry is a counted misprediction; a restarted node's old entries
attract nothing; Redis dies mid-run and every request still succeeds, then the
nodes rewrite the index."""

import json
import os
import signal
import time
import urllib.request

import openai
import msgspec
import pytest
import redis

from splitserve.common import metric_names as names
from splitserve.common.hashing import hash_blocks
from splitserve.common.kv_events import IndexUpdate
from splitserve.common.kv_index import EVENTS_CHANNEL, blocks_key, seq_key
from splitserve.deploy.launcher import Cluster, free_port, start_redis
from splitserve.tests.metrics_text import sample_sum

MODEL = "SmolLM2-135M-Instruct"
BS = 16
PREFILLS = ("prefill-0", "prefill-1")
os.environ.setdefault("SPLITSERVE_QUIET", "1")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def node_metric(cluster: Cluster, name: str, metric_name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{cluster.node(name).addr}/metrics", timeout=10) as r:
        return sample_sum(r.read().decode(), metric_name, **labels)


def router_metric(cluster: Cluster, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=10) as r:
        return sample_sum(r.read().decode(), name, **labels)


def served(cluster: Cluster) -> dict[str, float]:
    return {p: node_metric(cluster, p, names.PREFILL_REQUESTS, outcome="ok")
            for p in PREFILLS}


def last_decision(cluster: Cluster) -> dict:
    return get_json(f"{cluster.url}/debug/decisions?limit=1")["decisions"][-1]


def epoch(cluster: Cluster, name: str) -> str:
    return get_json(f"{cluster.node(name).addr}/debug/state")["epoch"]


class Env:
    def __init__(self, cluster, redis_proc, port, tokenizer):
        self.cluster, self.redis_proc, self.port, self.tok = cluster, redis_proc, port, tokenizer
        self.r = redis.Redis(port=port, socket_timeout=2)
        self.client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0,
                                    timeout=120)

    def hashes(self, prompt: str) -> list[int]:
        return hash_blocks(self.tok(prompt)["input_ids"], BS, (MODEL,))

    def held(self, name: str) -> set[int]:
        return {int(m) for m in self.r.smembers(blocks_key(name, epoch(self.cluster, name)))}

    def wait_held(self, name: str, hashes: list[int], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not set(hashes) <= self.held(name):
            assert time.monotonic() < deadline, f"{name} never published {len(hashes)} hashes"
            time.sleep(0.05)

    def complete(self, prompt: str, max_tokens: int = 4):
        return self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                              temperature=0)


@pytest.fixture(scope="module")
def env(tokenizer):
    port = free_port()
    procs = [start_redis(port)[0]]
    # the prefill nodes' entries of the index are the subject: the decode node, which holds every
    # prompt too, neither prefills a repeated one itself nor is pulled from
    cluster = Cluster(prefill_nodes=2, decode_nodes=1, kv_backend="tcp", kv_cache_memory="128MiB",
                      redis_url=f"redis://127.0.0.1:{port}/0",
                      router_args=["--score-weights", "local_prefill_tokens=0", "--no-prefix-pull"])
    cluster.start()
    e = Env(cluster, procs, port, tokenizer)
    yield e
    cluster.stop()
    for p in e.redis_proc:
        p.kill()
        p.wait()


def long_prompt(topic: str, question: str) -> str:
    return (f"You are the help desk of a {topic} company. Answer briefly, politely and only with "
            f"facts from the manual. Mention the warranty when it matters. ") * 6 + question


def test_router_nodes_and_index_agree_on_hashes(env):
    prompt = long_prompt("kayak rental", "Can I bring a dog?")
    want = env.hashes(prompt)  # what the router computes for this prompt
    assert len(want) >= 8
    env.complete(prompt)
    d = last_decision(env.cluster)
    assert d["policy"] == "cache_aware" and d["prefill"] in PREFILLS and d["decode"] == "decode-0"
    env.wait_held(d["prefill"], want)  # the prefill node's full blocks, under its id + epoch
    env.wait_held("decode-0", want)  # and the decode node's, the same hashes
    other = next(p for p in PREFILLS if p != d["prefill"])
    assert not set(want) & env.held(other)
    # Hashed once: both nodes adopted the hashes the router carried, none re-hashed.
    for name in (d["prefill"], "decode-0"):
        assert node_metric(env.cluster, name, names.PROMPT_HASHES, result="adopted") >= 1
        assert node_metric(env.cluster, name, names.PROMPT_HASHES, result="rehashed") == 0


def test_repeated_prefix_goes_to_the_node_that_holds_it(env):
    first = long_prompt("bicycle repair", "Do you fix brakes?")
    env.complete(first)
    holder = last_decision(env.cluster)["prefill"]
    env.wait_held(holder, env.hashes(first)[:8])
    for question in ("When do you open?", "Do you sell helmets?", "Is parking free?"):
        # Let the router see the holder idle again: the node's heartbeat is nudged when a
        # request finishes, and the router re-reads the node registry every poll (0.5 s).
        time.sleep(0.7)
        before = served(env.cluster)
        r = env.complete(long_prompt("bicycle repair", question))
        after = served(env.cluster)
        d = last_decision(env.cluster)
        assert d["prefill"] == holder, json.dumps(d)
        assert after[holder] == before[holder] + 1  # the node itself says it served it
        assert d["node_cached_tokens"][holder] >= 8 * BS
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        assert d["delivered_cached_tokens"] == r.usage.prompt_tokens_details.cached_tokens
        assert d["outcome"] == "hit"


def test_stale_entry_is_a_counted_misprediction_not_an_error(env):
    prompt = long_prompt("volcano tour", "What should I wear?")
    fresh = env.hashes(prompt)
    target = PREFILLS[1]
    # An entry claiming blocks the node never computed (as if it evicted them unseen),
    # written and published as the node's next batch would be.
    ep = epoch(env.cluster, target)
    env.r.sadd(blocks_key(target, ep), *map(str, fresh))
    seq = env.r.incr(seq_key(target, ep))
    env.r.publish(EVENTS_CHANNEL, msgspec.msgpack.encode(IndexUpdate(target, ep, seq, stored=fresh)))
    time.sleep(0.3)  # the router's mirror applies it
    misses = router_metric(env.cluster, names.PREFIX_PREDICTIONS, outcome="miss")
    r = env.complete(prompt)
    assert r.choices[0].text is not None and r.usage.prompt_tokens_details.cached_tokens == 0
    d = last_decision(env.cluster)
    assert d["prefill"] == target and d["predicted_cached_tokens"] > 0
    assert d["outcome"] == "miss"
    assert router_metric(env.cluster,
                         names.PREFIX_PREDICTIONS, outcome="miss") == misses + 1


def restart_node(cluster: Cluster, name: str, timeout: float = 180.0) -> None:
    """SIGKILL node ``name`` (no clean shutdown: its Redis entries stay behind) and
    start it again under the same node id; returns once it is READY."""
    old = cluster.node(name)
    os.killpg(old.popen.pid, signal.SIGKILL)
    old.popen.wait()
    role, index = name.rsplit("-", 1)
    cluster.wait_ready(cluster.start_node(role, int(index)), timeout)


def test_restarted_node_old_entries_attract_nothing(env):
    prompt = long_prompt("glacier hiking", "How cold is it?")
    hashes = env.hashes(prompt)
    env.complete(prompt)
    holder = last_decision(env.cluster)["prefill"]
    old_epoch = epoch(env.cluster, holder)
    env.wait_held(holder, hashes)
    restart_node(env.cluster, holder)  # SIGKILL: its old entries stay in Redis
    assert epoch(env.cluster, holder) != old_epoch
    assert set(hashes) <= {int(m) for m in env.r.smembers(blocks_key(holder, old_epoch))}
    time.sleep(2.0)  # a few discovery polls: the router reads the new epoch
    env.complete(long_prompt("glacier hiking", "Do I need boots?"))
    d = last_decision(env.cluster)
    assert holder not in d["node_cached_tokens"], d  # the old epoch is never read
    assert d["outcome"] != "miss"


def test_redis_killed_mid_run_requests_still_succeed_and_the_index_comes_back(env):
    prompt = long_prompt("ferry", "Can I take my car?")
    env.complete(prompt)
    holder = last_decision(env.cluster)["prefill"]
    env.wait_held(holder, env.hashes(prompt))
    skipped = router_metric(env.cluster, names.PREFIX_INDEX_LOOKUPS, result="skipped")
    env.redis_proc[-1].kill()
    env.redis_proc[-1].wait()
    time.sleep(0.3)  # the router's mirror notices its connection is gone
    for question in ("Is there food?", "How long is the trip?", "Are pets allowed?", "Wifi?"):
        r = env.complete(long_prompt("ferry", question))
        assert r.usage.completion_tokens == 4
        assert last_decision(env.cluster)["predicted_cached_tokens"] is None  # load only
    assert router_metric(env.cluster,
                         names.PREFIX_INDEX_LOOKUPS, result="skipped") > skipped
    # Redis comes back empty: the nodes re-register and rewrite their entries
    env.redis_proc.append(start_redis(env.port)[0])
    time.sleep(0.6)  # a discovery poll reaches the empty Redis before the nodes' heartbeats do
    assert env.complete(long_prompt("ferry", "Any cabins?")).usage.completion_tokens == 4
    deadline = time.monotonic() + 30
    while len(env.r.keys("splitserve:node:*")) < 3:  # the next heartbeats re-register
        assert time.monotonic() < deadline, "nodes did not re-register"
        time.sleep(0.1)
    env.wait_held(holder, env.hashes(prompt)[:8])
    env.wait_held("decode-0", env.hashes(prompt)[:8])
    time.sleep(1.5)  # past the router's lookup back-off and a discovery poll
    env.complete(long_prompt("ferry", "Is there a discount?"))
    d = last_decision(env.cluster)
    assert d["predicted_cached_tokens"] and d["predicted_cached_tokens"] >= 8 * BS
