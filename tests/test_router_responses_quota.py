"""A flood of stored /v1/responses from one API key, against a real router process, a
simulated decode node, the node registry's Redis and a Redis of the responses' own
(--responses-redis-url): the flooding key gets 429 with Retry-After and an OpenAI error
body, another key's stored responses survive and it still stores, "store": false
requests go on, and the responses' Redis grows by at most the store's budget (INFO
memory, with the slack stated below)."""

import json
import urllib.error
import urllib.request

import pytest
import redis

from splitserve.deploy.launcher import SimCluster, start_redis

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY_A, KEY_B, KEY_C = "flood-key-a-0123456789", "quiet-key-b-0123456789", "flood-key-c-0123456789"
KiB, MiB = 1024, 1 << 20
BUDGET, KEY_QUOTA = 1 * MiB, 512 * KiB
# Redis's memory beyond what the store counts (each entry's allocation and index
# entries): its own tables growing (the keyspace's and expiry's hash tables double, the
# index's sorted sets leave their compact encoding past 128 members).
SLACK = 128 * KiB
INPUT = "word " * 3200  # 16,000 bytes, ~3,200 tokens


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("".join(f"{k}\n" for k in (KEY_A, KEY_B, KEY_C)))
    keys.chmod(0o600)
    proc, responses_url = start_redis()
    c = SimCluster(0, 1, fleet_procs=1, sim_args=["--sim-speedup", "50"], kv_cache_memory="256MiB",
                   router_args=["--api-key-file", str(keys), "--responses-redis-url", responses_url,
                                "--responses-max-bytes", "1MiB", "--responses-key-max-bytes", "512KiB"])
    try:
        with c:
            yield c, redis.Redis.from_url(responses_url)
    finally:
        proc.kill()
        proc.wait()


def call(url: str, key: str, method: str = "POST", body: dict | None = None) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def create(c: SimCluster, key: str, **extra) -> tuple[int, dict, dict]:
    return call(f"{c.url}/v1/responses", key,
                body={"model": MODEL, "input": INPUT, "max_output_tokens": 4, **extra})


def flood(c: SimCluster, key: str, limit: int = 80) -> tuple[list[str], tuple[int, dict, dict]]:
    """Store responses as ``key`` until refused: (the stored ids, the refusal)."""
    ids = []
    for _ in range(limit):
        status, body, headers = create(c, key)
        if status != 200:
            return ids, (status, body, headers)
        ids.append(body["id"])
    raise AssertionError(f"{limit} responses stored, none refused")


def test_a_flooding_key_is_refused_and_evicts_nobody(cluster):
    c, responses = cluster
    kept_b = [create(c, KEY_B)[1]["id"]]
    base = responses.info("memory")["used_memory"]  # once the store's script is loaded (~360 KiB)
    kept_b.append(create(c, KEY_B)[1]["id"])
    ids_a, (status, body, headers) = flood(c, KEY_A)
    assert status == 429, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "rate_limit_error" and "store" in body["error"]["message"]
    assert 1 <= int(headers["Retry-After"]) <= 3600
    assert 20 <= len(ids_a) <= 26  # 512 KiB of ~21 KiB entries (17 KiB of text)
    assert create(c, KEY_A, store=False)[0] == 200  # not stored: not limited
    for rid in kept_b:  # B's responses survived the flood, and B still stores
        status, got, _ = call(f"{c.url}/v1/responses/{rid}", KEY_B, "GET")
        assert status == 200 and got["id"] == rid
    assert create(c, KEY_B)[0] == 200
    for rid in ids_a:  # A's own stay too: refusing a key evicts nothing of its either
        assert call(f"{c.url}/v1/responses/{rid}", KEY_A, "GET")[0] == 200
    # C floods into the rest of the budget; once it is full, C is refused (429 over its
    # share of the full store, 503 within it) and nobody is evicted
    _, (status, body, headers) = flood(c, KEY_C)
    assert status in (429, 503) and int(headers["Retry-After"]) >= 1, body
    assert call(f"{c.url}/v1/responses/{kept_b[0]}", KEY_B, "GET")[0] == 200
    grown = responses.info("memory")["used_memory"] - base
    print(f"responses' Redis grew {grown / KiB:.0f} KiB for a budget of {BUDGET / KiB:.0f} KiB")
    assert grown <= BUDGET + SLACK, grown
    # deleting gives the bytes back: A stores again
    assert call(f"{c.url}/v1/responses/{ids_a[0]}", KEY_A, "DELETE")[0] == 200
    assert call(f"{c.url}/v1/responses/{ids_a[1]}", KEY_A, "DELETE")[0] == 200
    assert create(c, KEY_A)[0] == 200
