"""Mid-stream migration on real processes: a router with ``--migration-limit 1`` in
front of one prefill and two decode nodes (the bundled model, fp32 on the CPU, shm KV
transport, Redis with a password, the cluster token, supervised as ``splitserve up``
runs them). The decode node streaming a chat completion is killed with SIGKILL
mid-stream; the client's stream must go on as if nothing happened: one role chunk,
one id, no error, every token, and for greedy the very text of an uninterrupted run
(the greedy continuation of prompt + streamed tokens equals the uninterrupted greedy
output: true token for token in fp32 here)."""

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from splitserve.benchmarks.harness import MODEL, wait_pools_free
from splitserve.common import metric_names as names
from splitserve.common.auth import new_cluster_token
from splitserve.deploy.launcher import Cluster

pytestmark = pytest.mark.slow
os.environ.setdefault("SPLITSERVE_QUIET", "1")
PROMPT = "Write a short story about a lighthouse keeper and a storm."
MAX_TOKENS = 48
NODES = ("prefill-0", "decode-0", "decode-1")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(prefill_nodes=1, decode_nodes=2, kv_backend="shm", kv_cache_memory="48MiB",
                cluster_token=new_cluster_token(), redis_password=new_cluster_token(),
                router_args=["--migration-limit", "1"])
    c.start()
    c.supervise()
    yield c
    c.stop()


class Streamed:
    """What a client saw of one streamed chat completion."""

    def __init__(self):
        self.events: list[dict] = []
        self.done = False

    @property
    def text(self) -> str:
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in self.events if e.get("choices"))

    @property
    def finish_reason(self) -> str | None:
        return next((e["choices"][0]["finish_reason"] for e in self.events
                     if e.get("choices") and e["choices"][0]["finish_reason"]), None)


async def stream_chat(url: str, stop: list[str] | None = None, on_chunk=None, extra: dict | None = None) -> Streamed:
    """Stream one greedy chat completion to its end; ``await on_chunk(n)`` after the
    n-th content chunk. ``extra``: more request fields."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **(extra or {})}
    if stop:
        body["stop"] = stop
    out, content_chunks = Streamed(), 0
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/chat/completions", json=body,
                                                    timeout=aiohttp.ClientTimeout(total=180)) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                out.done = True
                break
            event = json.loads(line[6:])
            out.events.append(event)
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                content_chunks += 1
                if on_chunk is not None:
                    await on_chunk(content_chunks)
    return out


async def kill_streaming_decode_node(c: Cluster, killed: list) -> None:
    """SIGKILL the decode node that holds a stream now (once)."""
    async with aiohttp.ClientSession(headers=c.auth_headers()) as s:
        for name in ("decode-0", "decode-1"):
            p = c.node(name)
            if p.popen.poll() is not None or not p.ready.is_set() or (name, p.popen.pid) in killed:
                continue  # killed before, not back yet
            async with s.get(f"{p.addr}/debug/state") as r:
                if (await r.json())["streams"]:
                    killed.append((name, p.popen.pid))
                    os.killpg(p.popen.pid, signal.SIGKILL)
                    return
    raise AssertionError("no decode node is streaming")


def migrations(c: Cluster) -> float:
    import urllib.request
    with urllib.request.urlopen(f"{c.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith(names.REQUEST_MIGRATIONS + "{"))
    return float(line.rsplit(" ", 1)[1])


def wait_back(c: Cluster, name: str, old_pid: int) -> None:
    t0 = time.monotonic()
    while not (c.node(name).popen.pid != old_pid and c.node(name).ready.is_set()):
        assert time.monotonic() - t0 < 120, f"{name} did not come back"
        time.sleep(0.1)
    c.wait_for_nodes(3, 120)


def kill_after(c: Cluster, chunks: int, killed: list):
    async def on_chunk(n: int) -> None:
        if n == chunks and not killed:
            await kill_streaming_decode_node(c, killed)
    return on_chunk


def test_killed_decode_node_mid_stream_the_stream_completes_unchanged(cluster):
    ref = asyncio.run(stream_chat(cluster.url))
    assert ref.done and ref.events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    before = migrations(cluster)

    killed: list = []
    got = asyncio.run(stream_chat(cluster.url, on_chunk=kill_after(cluster, 4, killed)))
    assert killed, "the stream ended before the kill"
    assert got.done and not [e for e in got.events if "error" in e], got.events[-3:]
    assert migrations(cluster) == before + 1
    assert len({e["id"] for e in got.events}) == 1
    roles = [e for e in got.events if e.get("choices") and "role" in e["choices"][0]["delta"]]
    assert len(roles) == 1
    assert got.events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert got.events[-1]["usage"]["prompt_tokens"] == ref.events[-1]["usage"]["prompt_tokens"]
    assert got.finish_reason == "length"
    assert got.text == ref.text  # token-exact greedy continuation (fp32)

    wait_back(cluster, *killed[0])
    asyncio.run(wait_pools_free([cluster.node(n).addr for n in NODES], cluster.auth_headers(), 10.0))


def test_json_schema_output_stays_valid_across_a_migration(cluster):
    """The new leg's grammar resumes past the tokens already streamed (resume_token_ids):
    the client gets one valid JSON document, not a second one started mid-way."""
    import jsonschema
    schema = {"type": "object", "additionalProperties": False, "required": ["title", "words"],
              "properties": {"title": {"type": "string", "maxLength": 30},
                             "words": {"type": "array", "minItems": 3, "maxItems": 3,
                                       "items": {"type": "string", "maxLength": 12}}}}
    extra = {"max_tokens": 64, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "story", "schema": schema}}}
    before, killed = migrations(cluster), []
    got = asyncio.run(stream_chat(cluster.url, on_chunk=kill_after(cluster, 4, killed), extra=extra))
    assert killed and got.done and migrations(cluster) == before + 1
    assert got.finish_reason == "stop"
    jsonschema.validate(json.loads(got.text), schema)
    wait_back(cluster, *killed[0])
    asyncio.run(wait_pools_free([cluster.node(n).addr for n in NODES], cluster.auth_headers(), 10.0))


def test_stop_string_after_the_migration_point_still_stops(cluster):
    ref = asyncio.run(stream_chat(cluster.url))
    text = ref.text
    # a stop string whose first occurrence lies in the last third of the text: after the kill
    start = next(i for i in range(2 * len(text) // 3, len(text) - 4) if text.find(text[i:i + 4]) == i)
    stop = text[start:start + 4]
    want = asyncio.run(stream_chat(cluster.url, stop=[stop]))
    assert want.finish_reason == "stop" and want.text == text[:start]

    killed: list = []
    got = asyncio.run(stream_chat(cluster.url, stop=[stop], on_chunk=kill_after(cluster, 3, killed)))
    assert killed and got.done and not [e for e in got.events if "error" in e]
    assert got.finish_reason == "stop" and got.text == text[:start]
    wait_back(cluster, *killed[0])
    asyncio.run(wait_pools_free([cluster.node(n).addr for n in NODES], cluster.auth_headers(), 10.0))


def test_bad_migration_limit_is_refused():
    import subprocess
    import sys
    for value in ("-1", "17", "two"):
        r = subprocess.run([sys.executable, "-m", "splitserve.cli", "router", "--port", "0",
                            "--migration-limit", value], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "migration-limit" in r.stderr.replace("_", "-"), (value, r.stderr[-300:])


def test_past_the_limit_the_stream_ends_with_the_clean_error(cluster):
    """--migration-limit 1: the second dead decode node ends the stream with an error
    event (then [DONE]), as without migration. Last: it leaves both decode nodes restarting."""
    killed: list = []

    async def on_chunk(n: int) -> None:
        if n in (3, 8) and len(killed) < (1 if n == 3 else 2):
            await kill_streaming_decode_node(cluster, killed)
    before = migrations(cluster)
    got = asyncio.run(stream_chat(cluster.url, on_chunk=on_chunk))
    assert len(killed) == 2 and killed[0][0] != killed[1][0]
    assert got.done and "error" in got.events[-1] and got.finish_reason is None
    assert migrations(cluster) == before + 1
