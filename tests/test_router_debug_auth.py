"""/debug/decisions shows every client's traffic (when, prompt sizes, TTFT, cached
tokens): only the cluster token reads it, never a client's API key; a router with
neither API keys nor a cluster token (loopback, tests) keeps it open. /metrics under
--protect-metrics takes the cluster token too (what the planner presents). Real router
apps on real sockets, a real redis-server, no nodes."""

import pytest

from splitserve.common.auth import CLUSTER_TOKEN_HEADER
from splitserve.router.app import start_router
from splitserve.router.config import RouterConfig

pytestmark = pytest.mark.anyio

KEY = "client-key-0123456789"
TOKEN = "cluster-token-0123456789"


@pytest.fixture(scope="module")
async def routers(redis_url):
    made = {}
    for name, kw in (("keys+token", dict(api_keys=(KEY,), cluster_token=TOKEN, protect_metrics=True)),
                     ("keys", dict(api_keys=(KEY,))), ("open", {})):
        made[name] = await start_router(RouterConfig(host="127.0.0.1", port=0, redis_url=redis_url, **kw))
    yield {name: r.url for name, r in made.items()}
    for r in made.values():
        await r.stop()


async def get(http, url: str, headers: dict) -> tuple[int, dict | str]:
    async with http.get(url, headers=headers) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


@pytest.mark.parametrize("headers", [{}, {"Authorization": f"Bearer {KEY}"},
                                     {CLUSTER_TOKEN_HEADER: TOKEN + "x"},
                                     {"Authorization": f"Bearer {TOKEN}"}],
                         ids=["nothing", "api-key", "wrong-token", "token-as-bearer"])
async def test_decisions_refuse_anything_but_the_cluster_token(routers, http, headers):
    status, body = await get(http, routers["keys+token"] + "/debug/decisions", headers)
    assert status in (401, 403), body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "cluster token" in body["error"]["message"]


async def test_decisions_answer_the_cluster_token(routers, http):
    status, body = await get(http, routers["keys+token"] + "/debug/decisions", {CLUSTER_TOKEN_HEADER: TOKEN})
    assert status == 200 and body == {"decisions": []}


async def test_without_a_cluster_token_an_api_key_reads_no_decisions(routers, http):
    status, body = await get(http, routers["keys"] + "/debug/decisions", {"Authorization": f"Bearer {KEY}"})
    assert status == 403 and "cluster token" in body["error"]["message"], body
    assert (await get(http, routers["open"] + "/debug/decisions", {}))[0] == 200  # nothing is closed there


async def test_protected_metrics_take_an_api_key_or_the_cluster_token(routers, http):
    url = routers["keys+token"] + "/metrics"
    assert (await get(http, url, {}))[0] == 401
    assert (await get(http, url, {CLUSTER_TOKEN_HEADER: TOKEN + "x"}))[0] == 401
    for headers in ({"Authorization": f"Bearer {KEY}"}, {CLUSTER_TOKEN_HEADER: TOKEN}):
        status, text = await get(http, url, headers)
        assert status == 200 and "splitserve:" in text
