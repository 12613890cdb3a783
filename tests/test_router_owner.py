"""Who owns a stored response: an HMAC of the API key under a secret derived from the
cluster token (router/http/auth.py), so router replicas of one cluster agree, another
cluster's routers do not, and Redis holds no plain hash of a key (which would confirm a
guessed key offline). Real router apps on real sockets and a real redis-server."""

import hashlib

import pytest

from splitserve.router.app import start_router
from splitserve.router.http.auth import owner_id
from splitserve.router.config import RouterConfig
from splitserve.router.responses.store import ResponseStore

pytestmark = pytest.mark.anyio

KEY = "tenant-key-0123456789"
TOKEN, OTHER_TOKEN = "cluster-token-0123456789", "another-cluster-0123456789"


def test_owner_is_an_hmac_under_the_cluster_token():
    plain = hashlib.sha256(KEY.encode()).hexdigest()[:32]
    assert owner_id(TOKEN, KEY) == owner_id(TOKEN, KEY)  # replicas sharing the token agree
    assert len({plain, owner_id(TOKEN, KEY), owner_id(OTHER_TOKEN, KEY), owner_id(None, KEY)}) == 4
    assert owner_id(TOKEN, KEY) != owner_id(TOKEN, KEY + "x")
    assert TOKEN not in owner_id(TOKEN, KEY) and KEY not in owner_id(TOKEN, KEY)


async def test_routers_find_the_responses_of_a_key_under_their_clusters_owner(redis_url, http):
    config = RouterConfig(host="127.0.0.1", port=0, redis_url=redis_url, api_keys=(KEY,), cluster_token=TOKEN)
    store = ResponseStore(redis_url, config.responses_max_bytes, config.responses_key_max_bytes,
                          config.responses_key_max_entries, config.prepare_thread_bytes)
    ours, other = await start_router(config), await start_router(
        RouterConfig(host="127.0.0.1", port=0, redis_url=redis_url, api_keys=(KEY,), cluster_token=OTHER_TOKEN))
    plain = hashlib.sha256(KEY.encode()).hexdigest()[:32]  # the owner before the HMAC (unreadable now)
    try:
        for rid, owner in (("resp_hmac", owner_id(TOKEN, KEY)), ("resp_plain", plain)):
            await store.put({"id": rid, "object": "response", "output": []}, [], owner)

        async def status(router, rid: str) -> int:
            async with http.get(f"{router.url}/v1/responses/{rid}",
                                headers={"Authorization": f"Bearer {KEY}"}) as r:
                return r.status
        assert await status(ours, "resp_hmac") == 200
        assert await status(other, "resp_hmac") == 404  # another cluster's secret: another owner
        assert await status(ours, "resp_plain") == 404
    finally:
        await store.close()
        await ours.stop()
        await other.stop()
