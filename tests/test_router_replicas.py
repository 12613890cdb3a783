"""Several routers behind one Redis (``splitserve up --router-replicas``): each keeps
its own prefix-index mirror from the nodes' events, so at steady state they make the
same decision for the same prompt, and when one dies the others keep routing
cache-aware while the supervisor restarts it (it catches up from the snapshots)."""

import json
import os
import signal
import time
import urllib.request

import openai
import pytest

from splitserve.deploy.launcher import SimCluster

MODEL = "SmolLM2-135M-Instruct"
BS = 16
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
        time.sleep(1.5)  # index events and a registry poll
        # Steady state: the same (fully cached) prompt through A, then B.
        agree = 0
        for p in convs:
            complete(a, p)
            da = last_decision(a)
            complete(b, p)
            db = last_decision(b)
            assert da["outcome"] == db["outcome"] == "hit", (da, db)
            agree += (da["prefill"], da["node_cached_tokens"]) == (db["prefill"], db["node_cached_tokens"])
        assert agree == len(convs)  # every decision (the prompts repeat: no tie to rotate)

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
