"""Cache isolation end to end (vLLM's ``cache_salt``, and API keys that carry a salt): a
real redis-server, a prefill node, a decode node and the router, each a real process, on
the bundled model, driven through the official openai client.

Tenants whose API keys carry different salts send the same long prompt: neither gets a
cached token from the other, the router predicts no hit for the other's blocks, and
the nodes publish each tenant's blocks under its own salted hashes, while each tenant's
repeat hits its own cache. The same holds for explicit ``cache_salt`` values on one key,
and a request's salt never reaches another key's namespace. Every endpoint answers a bad
``cache_salt`` with a 400 naming it."""

import json
import os
import time
import urllib.error
import urllib.request

import openai
import pytest
import redis

from splitserve.common import metric_names as names
from splitserve.common.hashing import hash_blocks
from splitserve.common.prompt_ref import PromptKeys
from splitserve.common.kv_index import blocks_key
from splitserve.deploy.launcher import Cluster
from splitserve.router.api_keys import ApiKey, derived_salt, effective_cache_salt
from splitserve.tests.metrics_text import sample_sum

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BS = 16
KEY_A, KEY_B, KEY_C = "tenant-a-key-0123456789", "tenant-b-key-0123456789", "plain-key-0123456789"
KEY_D, KEY_E = "plain-key-d-0123456789", "plain-key-e-0123456789"  # no salts: one cache each
KEY_F, KEY_G = "team-key-f-0123456789", "team-key-g-0123456789"  # one explicit salt: one cache
TOKEN = "salt-cluster-token-0123456789"  # /debug/decisions answers it alone, not an API key
os.environ.setdefault("SPLITSERVE_QUIET", "1")

PROMPT = ("You are the help desk of a lighthouse museum. Answer briefly, politely and only with facts "
          "from the guide. Mention the opening hours when it matters. ") * 6 + "Can I climb the tower?"


@pytest.fixture(scope="module")
def cluster():
    keys = (ApiKey(KEY_A, "tenant-a"), ApiKey(KEY_B, "tenant-b"), ApiKey(KEY_C), ApiKey(KEY_D), ApiKey(KEY_E),
            ApiKey(KEY_F, "team"), ApiKey(KEY_G, "team"))
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory="128MiB",
                 api_keys=keys, cluster_token=TOKEN) as c:
        yield c


def client(cluster: Cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=key, max_retries=0, timeout=120)


def complete(cluster: Cluster, key: str, cache_salt: str | None = None) -> int:
    """Send PROMPT with ``key`` (and ``cache_salt``); the prompt tokens it got from a cache."""
    extra = {} if cache_salt is None else {"cache_salt": cache_salt}
    r = client(cluster, key).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                                extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


def last_decision(cluster: Cluster) -> dict:
    req = urllib.request.Request(f"{cluster.url}/debug/decisions?limit=1", headers=cluster.auth_headers())
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["decisions"][-1]


def held(cluster: Cluster, name: str) -> set[int]:
    """The block hashes node ``name`` holds in the prefix index, as Redis has them."""
    req = urllib.request.Request(f"{cluster.node(name).addr}/debug/state", headers=cluster.auth_headers())
    with urllib.request.urlopen(req, timeout=10) as r:
        epoch = json.loads(r.read())["epoch"]
    with redis.Redis.from_url(cluster.redis_url, socket_timeout=2) as r:
        return {int(m) for m in r.smembers(blocks_key(name, epoch))}


def wait_held(cluster: Cluster, hashes: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    for name in ("prefill-0", "decode-0"):
        while not set(hashes) <= held(cluster, name):
            assert time.monotonic() < deadline, f"{name} never published the salted hashes"
            time.sleep(0.05)
    time.sleep(0.3)  # the router's mirror follows the index over pub/sub


def prompt_hashes(tokenizer, salt: str | None) -> list[int]:
    return hash_blocks(tokenizer(PROMPT)["input_ids"], BS, PromptKeys(model=MODEL, cache_salt=salt).hash_keys())


def node_metric(cluster: Cluster, name: str, metric: str) -> float:
    with urllib.request.urlopen(f"{cluster.node(name).addr}/metrics", timeout=10) as r:
        return sample_sum(r.read().decode(), metric)


def test_tenants_with_salted_keys_never_hit_each_others_cache(cluster, tokenizer):
    salted_a = prompt_hashes(tokenizer, effective_cache_salt("tenant-a", None))
    assert len(salted_a) >= 8
    assert complete(cluster, KEY_A) == 0
    wait_held(cluster, salted_a)  # both nodes published tenant A's blocks under A's hashes
    unsalted = set(prompt_hashes(tokenizer, None))
    assert not unsalted & (held(cluster, "prefill-0") | held(cluster, "decode-0"))
    # A's repeat: predicted and delivered from A's own cache
    assert complete(cluster, KEY_A) >= 8 * BS
    d = last_decision(cluster)
    assert d["predicted_cached_tokens"] >= 8 * BS and d["delivered_cached_tokens"] >= 8 * BS
    # B, same prompt, A's blocks in every cache and the index: nothing for B, not even predicted
    hits_before = node_metric(cluster, "prefill-0", names.PREFIX_CACHE_HITS)
    assert complete(cluster, KEY_B) == 0
    d = last_decision(cluster)
    assert d["predicted_cached_tokens"] == 0 and d["node_cached_tokens"] == {}, d
    assert d["delivered_cached_tokens"] == 0
    assert node_metric(cluster, "prefill-0", names.PREFIX_CACHE_HITS) == hits_before
    salted_b = prompt_hashes(tokenizer, effective_cache_salt("tenant-b", None))
    assert not set(salted_a) & set(salted_b)
    wait_held(cluster, salted_b)
    assert complete(cluster, KEY_B) >= 8 * BS  # B's own repeat hits
    assert last_decision(cluster)["predicted_cached_tokens"] >= 8 * BS
    # A request's own cache_salt narrows its key's cache, never leaves it
    assert complete(cluster, KEY_A, cache_salt="tenant-b") == 0
    assert last_decision(cluster)["node_cached_tokens"] == {}


def test_keys_without_a_salt_never_hit_each_others_cache_keys_naming_one_salt_share_it(cluster, tokenizer):
    """Keys configured without a cache salt each get their own (derived from the key): the
    same long prompt from another such key gets no cached token and no predicted hit.
    Keys naming the same salt share one cache: the second one's first request hits."""
    assert complete(cluster, KEY_D) == 0
    wait_held(cluster, prompt_hashes(tokenizer, effective_cache_salt(derived_salt(TOKEN, KEY_D), None)))
    assert complete(cluster, KEY_D) >= 8 * BS  # its own repeat hits
    assert complete(cluster, KEY_E) == 0  # D's blocks are in every cache: none of them is E's
    d = last_decision(cluster)
    assert d["predicted_cached_tokens"] == 0 and d["node_cached_tokens"] == {}, d
    assert complete(cluster, KEY_F) == 0
    wait_held(cluster, prompt_hashes(tokenizer, effective_cache_salt("team", None)))
    assert complete(cluster, KEY_G) >= 8 * BS  # G's first request: F's blocks, its team's
    assert last_decision(cluster)["predicted_cached_tokens"] >= 8 * BS


def test_explicit_cache_salts_on_one_key_isolate_and_repeat(cluster, tokenizer):
    key_c = derived_salt(TOKEN, KEY_C)  # KEY_C has no salt of its own: the one derived from it
    assert complete(cluster, KEY_C, cache_salt="x") == 0
    wait_held(cluster, prompt_hashes(tokenizer, effective_cache_salt(key_c, "x")))
    assert complete(cluster, KEY_C, cache_salt="y") == 0  # another salt: no hit
    d = last_decision(cluster)
    assert d["predicted_cached_tokens"] == 0 and d["node_cached_tokens"] == {}, d
    assert complete(cluster, KEY_C) == 0  # no request salt: the key's own cache, which holds none of it
    assert complete(cluster, KEY_C, cache_salt="x") >= 8 * BS  # its own salt again: a hit
    assert last_decision(cluster)["predicted_cached_tokens"] >= 8 * BS
    assert complete(cluster, KEY_A, cache_salt="x") == 0  # tenant A's "x" is not the key's "x"
    # the Responses API maps onto chat with the same salt: a chat turn then hits its blocks
    c = client(cluster, KEY_C)
    first = c.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2, temperature=0,
                               extra_body={"cache_salt": "r"})
    assert first.usage.input_tokens_details.cached_tokens == 0
    time.sleep(0.5)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                     max_tokens=2, temperature=0, extra_body={"cache_salt": "r"})
    assert chat.usage.prompt_tokens_details.cached_tokens >= 8 * BS
    other = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                      max_tokens=2, temperature=0, extra_body={"cache_salt": "s"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/responses", {"input": "Hi"}),
])
@pytest.mark.parametrize("salt", ["", 5, ["a"], {"a": 1}, "s" * 2000])
def test_a_bad_cache_salt_is_a_400_naming_it(cluster, path, body, salt):
    req = urllib.request.Request(f"{cluster.url}{path}", data=json.dumps(
        {"model": MODEL, "max_tokens" if path != "/v1/responses" else "max_output_tokens": 2, **body,
         "cache_salt": salt}).encode(), headers={"Content-Type": "application/json",
                                                 "Authorization": f"Bearer {KEY_C}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["param"] == "cache_salt"


def test_a_stored_response_belongs_to_the_key_that_made_it(cluster):
    """Another tenant can neither read, delete nor continue a stored response, even with
    its id: the answers are those for an unknown id."""
    a, b = client(cluster, KEY_A), client(cluster, KEY_B)
    first = a.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4, temperature=0)
    assert a.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        b.responses.create(model=MODEL, input="And again.", previous_response_id=first.id, max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    follow = a.responses.create(model=MODEL, input="And again.", previous_response_id=first.id,
                                max_output_tokens=4, temperature=0)
    assert follow.status in ("completed", "incomplete")
    a.responses.delete(first.id)  # still there after b's attempt
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)
