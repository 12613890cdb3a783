"""Node discovery through a real redis-server: the router sees nodes registered with
`NodeRegistry`, ignores other models, answers /health by role, fails fast (502, no
hang) on a registered node that refuses connections, and keeps routing with the
last known nodes while Redis is down."""

import asyncio
import logging
import subprocess
import time

import aiohttp
import msgspec
import pytest

from splitserve.deploy.launcher import free_port
import redis

from splitserve.common import metric_names as names
from splitserve.common.node_registry import NodeInfo, NodeRegistry, new_epoch
from splitserve.router.app import start_router
from splitserve.router.config import RouterConfig
from splitserve.router.routing.discovery import UNREACHABLE_QUARANTINE_S
from splitserve.tests.metrics_text import sample_sum

pytestmark = pytest.mark.anyio

MODEL = "SmolLM2-135M-Instruct"
POLL_S = 0.05


class RedisServer:
    """A throwaway redis-server that a test can stop and start again on its port."""

    def __init__(self):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind",
                                      "127.0.0.1", "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
        client.close()

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def router(redis_server):
    running = await start_router(RouterConfig(host="127.0.0.1", port=0,
                                              redis_url=redis_server.url, poll_interval_s=POLL_S))
    yield running.url
    await running.stop()


@pytest.fixture
async def registry(redis_server):
    reg = NodeRegistry(redis_server.url, ttl_s=30.0)
    yield reg
    await reg.close()


def node(node_id: str, role: str, model: str = MODEL, addr: str | None = None) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, model=model, epoch=new_epoch(),
                    http_addr=addr or f"http://127.0.0.1:{free_port()}")  # nothing listens


async def get_json(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        return resp.status, await resp.json()


async def wait_health(router: str, timeout: float = 3.0, **want) -> dict:
    """Poll /health until it reports ``want`` (a few discovery polls by default)."""
    deadline = time.monotonic() + timeout
    while True:
        _, body = await get_json(router + "/health")
        if all(body[k] == v for k, v in want.items()) or time.monotonic() > deadline:
            return body
        await asyncio.sleep(POLL_S)


async def metric(router: str, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(router + "/metrics") as resp:
        text = await resp.text()
    return sample_sum(text, name, **labels)


async def test_health_counts_registered_nodes_by_role(router, registry):
    await registry.heartbeat(node("p0", "prefill"))
    body = await wait_health(router, prefill_nodes=1)
    assert body["prefill_nodes"] == 1 and body["decode_nodes"] == 0
    status, _ = await get_json(router + "/health")
    assert status == 503  # prefill nodes alone cannot serve

    await registry.heartbeat(node("d0", "decode"))
    await registry.heartbeat(node("c0", "colocated"))
    await registry.heartbeat(node("x0", "decode", model="another-model"))  # ignored
    body = await wait_health(router, decode_nodes=1, colocated_nodes=1)
    assert body == {"status": "ok", "prefill_nodes": 1, "decode_nodes": 1, "colocated_nodes": 1,
                    "redis": "ok"}
    status, _ = await get_json(router + "/health")
    assert status == 200
    assert await metric(router, names.ROUTER_NODES, role="decode") == 1

    await registry.deregister("d0")
    await registry.deregister("c0")
    body = await wait_health(router, decode_nodes=0, colocated_nodes=0)
    assert body["status"] == "no_decode_node"


async def test_unreachable_decode_node_fails_fast_with_502(router, registry):
    await registry.heartbeat(node("d0", "decode"))
    await registry.heartbeat(node("d1", "decode"))
    await wait_health(router, decode_nodes=2)
    started = time.monotonic()
    async with aiohttp.ClientSession() as s:
        async with s.post(router + "/v1/completions",
                          json={"model": MODEL, "prompt": "Hello", "stream": True}) as resp:
            assert resp.status == 502
            body = await resp.json()
    assert time.monotonic() - started < 5
    assert body["error"]["type"] == "upstream_error"
    assert "unreachable" in body["error"]["message"]
    # both nodes were tried, then set aside: the next request is told none is reachable
    assert await metric(router, names.ROUTING_DECISIONS) == 0
    async with aiohttp.ClientSession() as s:
        async with s.post(router + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status == 503
            assert "reachable" in (await resp.json())["error"]["message"]


async def test_decode_nodes_that_answer_503_give_the_client_a_503_with_retry_after(router, registry):
    """Nodes that are up but not taking the request now (draining, a grammar still
    compiling: node/app.py, node/grammar_service.py answer 503 + Retry-After): each is
    tried, then the client is asked to retry with the nodes' Retry-After, not told the
    upstream failed (502)."""
    from aiohttp import web

    asked: list[str] = []

    async def busy(request: web.Request) -> web.Response:
        asked.append(request.host)
        return web.json_response({"error": {"message": "the grammar is still compiling; retry",
                                            "type": "service_unavailable", "param": None, "code": None}},
                                 status=503, headers={"Retry-After": "7"})

    app = web.Application()
    app.router.add_post("/generate", busy)
    runner = web.AppRunner(app)
    await runner.setup()
    sites = [web.TCPSite(runner, "127.0.0.1", free_port()) for _ in range(2)]
    for site in sites:
        await site.start()
    try:
        for i, site in enumerate(sites):
            await registry.heartbeat(node(f"d{i}", "decode", addr=site.name))
        await wait_health(router, decode_nodes=2)
        async with aiohttp.ClientSession() as s:
            async with s.post(router + "/v1/completions", json={"model": MODEL, "prompt": "Hello"}) as resp:
                status, retry_after, body = resp.status, resp.headers.get("Retry-After"), await resp.json()
    finally:
        await runner.cleanup()
    assert (status, retry_after, body["error"]["type"]) == (503, "7", "service_unavailable"), body
    assert "retry" in body["error"]["message"] and len(asked) == 2  # both nodes tried


async def test_redis_outage_keeps_last_known_nodes(router, registry, redis_server, caplog):
    await registry.heartbeat(node("d0", "decode"))
    await wait_health(router, decode_nodes=1)
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="splitserve.router.routing.discovery"):
        body = await wait_health(router, redis="unreachable")
        await asyncio.sleep(5 * POLL_S)
    assert body["redis"] == "unreachable"
    assert body["decode_nodes"] == 1 and body["status"] == "ok"  # routing goes on
    assert await metric(router, names.REDIS_ERRORS) >= 3
    assert sum("Redis unreachable" in r.getMessage() for r in caplog.records) == 1  # once
    redis_server.start()  # an empty Redis: d0's record is gone with the old server
    body = await wait_health(router, redis="ok")
    # while nodes re-register, the last known ones stay routable for about one TTL ...
    assert body["redis"] == "ok" and body["decode_nodes"] == 1
    # ... then a node that never came back is dropped
    body = await wait_health(router, timeout=UNREACHABLE_QUARANTINE_S + 3, decode_nodes=0)
    assert body["decode_nodes"] == 0


async def test_nodes_with_another_block_size_are_ignored_and_the_nodes_context_bounds_prompts(
        router, registry, caplog):
    """A node hashing KV blocks of another size than the router's (16) is never routed to
    (one warning naming it); the smallest context the nodes report bounds the 400 check."""
    with caplog.at_level(logging.WARNING, logger="splitserve.router.routing.discovery"):
        await registry.heartbeat(msgspec.structs.replace(node("d32", "decode"), block_size=32))
        await registry.heartbeat(msgspec.structs.replace(node("d16", "decode"), block_size=16,
                                                         max_model_len=1024))
        body = await wait_health(router, decode_nodes=1)
        await asyncio.sleep(5 * POLL_S)
    assert body["decode_nodes"] == 1  # d16 only
    warnings = [r.getMessage() for r in caplog.records if "d32" in r.getMessage()]
    assert len(warnings) == 1 and "block size is 32" in warnings[0]

    async with aiohttp.ClientSession() as s:
        async with s.post(router + "/v1/completions",
                          json={"model": MODEL, "prompt": [1] * 1000, "max_tokens": 30}) as resp:
            assert resp.status == 400  # within the tokenizer's 8192, beyond the nodes' 1024
            err = (await resp.json())["error"]
    assert err["param"] == "max_tokens" and "1024" in err["message"]
