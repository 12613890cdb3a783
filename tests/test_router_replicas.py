"""Several routers behind one Redis (``splitserve up --router-replicas``): each keeps
its own prefix mirror from the nodes' events, so at steady state they make the
same decision for the same prompt, and when one dies the others keep routing
cache-aware while the supervisor restarts it (it catches up from the snapshots)."""

import asyncio
import dataclasses
import json
import os
import signal
import time
import urllib.request

import openai
import pytest

from splitserve.common.node_registry import NodeRegistry
from splitserve.deploy.launcher import SimCluster
from splitserve.router.routing.discovery import NodeDirectory

MODEL = "SmolLM2-135M-Instruct"
BS = 16
POLL_S = next(f.default for f in dataclasses.fields(NodeDirectory) if f.name == "poll_interval_s")
pytestmark = pytest.mark.slow


def last_decision(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/debug/decisions?limit=1", timeout=10) as r:
        return json.loads(r.read())["decisions"][-1]


def complete(url: str, prompt: list[int]):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)


def until(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def fleet_idle(redis_url: str) -> bool:
    """Every node's record in Redis shows nothing running, waiting or queued."""
    async def read():
        reg = NodeRegistry(redis_url)
        try:
            return await reg.list_nodes()
        finally:
            await reg.close()
    nodes = asyncio.run(read())
    return bool(nodes) and all(n.load.running == n.load.waiting == n.load.queued_prefill_tokens == 0
                               for n in nodes)


def settle(redis_url: str) -> None:
    """After a request has completed: until both routers see the fleet idle. Every
    node's record shows no load (a node beats when its load drops, and later beats
    show it idle too) and a node registry poll has read it. A decision made on a stale
    record of the other router's request would be load-aware routing, not a
    disagreement about the cache."""
    until(lambda: fleet_idle(redis_url))
    time.sleep(2 * POLL_S)


def prompts(n: int) -> list[list[int]]:
    # a shared 2-block system prompt, then 6-10 blocks of each conversation's own
    system = list(range(1000, 1000 + 2 * BS))
    return [system + [3000 + 97 * i + j for j in range((6 + i % 5) * BS)] for i in range(n)]


def test_two_routers_agree_and_survive_each_other():
    with SimCluster(4, 1, fleet_procs=1, sim_args=["--sim-speedup", "20"], kv_cache_memory="256MiB",
                    router_replicas=2) as c:
        c.supervise()
        a, b = c.urls
        assert len(c.urls) == 2 and a == c.url
        convs = prompts(8)
        for i, p in enumerate(convs):  # warm: the conversations land through either router
            complete(c.urls[i % 2], p)
        time.sleep(1.5)  # index events and a node registry poll
        # Steady state: the same (fully cached) prompt through A, then B.
        differ = []
        for p in convs:
            complete(a, p)
            da = last_decision(a)
            settle(c.redis_url)
            complete(b, p)
            db = last_decision(b)
            settle(c.redis_url)
            assert da["outcome"] == db["outcome"] == "hit", (da, db)
            if (da["prefill"], da["node_cached_tokens"]) != (db["prefill"], db["node_cached_tokens"]):
                differ.append((da, db))
        assert not differ  # every decision (the prompts repeat: no tie to rotate)

        # Kill A (no clean shutdown): B keeps routing cache-aware on its own mirror.
        old = c.node("router").popen
        os.killpg(old.pid, signal.SIGKILL)
        old.wait()
        for p in convs[:4]:
            r = complete(b, p + [7] * BS)
            d = last_decision(b)
            assert d["outcome"] == "hit" and r.usage.prompt_tokens_details.cached_tokens >= len(p) - BS
        # The supervisor restarts A on its port; it catches up from Redis and routes by cache.
        until(lambda: c.node("router").popen is not old and c.node("router").popen.poll() is None)

        def a_hits():
            try:
                complete(a, convs[5])
            except openai.APIConnectionError:
                return False
            return last_decision(a)["outcome"] == "hit"
        until(a_hits, 60.0)
