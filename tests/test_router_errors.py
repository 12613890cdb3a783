"""The real router app against a real redis-server with no nodes and the bundled
tokenizer: every bad input gets its status and an OpenAI error body naming the
field (raw HTTP and the official openai client), never a 500; 413, 404 and 503;
the read-only endpoints; x-request-id on every answer."""

import json
import logging

import aiohttp
import openai
import pytest

from splitserve.common import metric_names as names
from splitserve.router.app import start_router
from splitserve.router.config import RouterConfig
from splitserve.tests.metrics_text import sample_sum

pytestmark = pytest.mark.anyio

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 8192  # the bundled model's max_position_embeddings
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
async def router(redis_url):
    running = await start_router(RouterConfig(host="127.0.0.1", port=0, redis_url=redis_url))
    yield running.url
    await running.stop()


@pytest.fixture(scope="module")
async def client(router):
    async with openai.AsyncOpenAI(base_url=router + "/v1", api_key="unused",
                                  max_retries=0) as c:
        yield c


@pytest.fixture(autouse=True)
def no_unexpected_errors(caplog):
    """The 500 middleware must never trigger on bad input."""
    with caplog.at_level(logging.ERROR, logger="splitserve.router"):
        yield
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def post(http, url: str, body, headers=None) -> tuple[int, dict, aiohttp.typedefs.LooseHeaders]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"Content-Type": "application/json",
                                                  **(headers or {})}) as resp:
        return resp.status, await resp.json(), resp.headers


def assert_error(status: int, body: dict, want_status: int, param: str | None, code=None):
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    assert err["code"] == code
    if want_status in (400, 404, 413):
        assert err["type"] == "invalid_request_error"
    if param is not None:
        assert param.split("[")[0] in err["message"]  # the message names the field too


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, **fields}


BAD_COMPLETIONS = [
    (completion(max_tokens="ten"), "max_tokens"),
    (completion(max_tokens=True), "max_tokens"),
    (completion(max_tokens=0), "max_tokens"),
    (completion(max_tokens=1.5), "max_tokens"),
    (completion(temperature="hot"), "temperature"),
    (completion(temperature=-1), "temperature"),
    (completion(top_p=0), "top_p"),
    (completion(top_p=1.5), "top_p"),
    (completion(top_k=-5), "top_k"),
    (completion(min_p=2), "min_p"),
    (completion(presence_penalty=3), "presence_penalty"),
    (completion(frequency_penalty=-2.5), "frequency_penalty"),
    (completion(repetition_penalty=0), "repetition_penalty"),
    (completion(seed="x"), "seed"),
    (completion(seed=2**64), "seed"),
    (completion(stop=[1]), "stop[0]"),
    (completion(stop=[""]), "stop"),
    (completion(stop=[f"s{i}" for i in range(17)]), "stop"),
    (completion(n=0), "n"),
    (completion(n=17), "n"),
    (completion(prompt=["a"] * 9, n=16), "n"),  # 144 choices
    (completion(echo="yes"), "echo"),
    (completion(best_of=3), "best_of"),
    (completion(n=2, best_of=3), "best_of"),
    (completion(max_tokens=0, logprobs=1), "max_tokens"),  # scoring needs echo or prompt_logprobs
    (completion(max_tokens=5, min_tokens=6), "min_tokens"),
    (completion(min_tokens=-1), "min_tokens"),
    (completion(min_tokens="2"), "min_tokens"),
    (completion(prompt_logprobs=21), "prompt_logprobs"),
    (completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    (completion(echo=True, logprobs=21), "logprobs"),
    (completion(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
    (completion(logit_bias={"1": 101}), "logit_bias"),
    (completion(logit_bias={"1": -100.5}), "logit_bias"),
    (completion(logit_bias={"1": "x"}), "logit_bias"),
    (completion(logit_bias={"1": True}), "logit_bias"),
    (completion(logit_bias={"1": 10**400}), "logit_bias.1"),
    (completion(logit_bias={"hello": 1}), "logit_bias"),
    (completion(logit_bias={"-1": 1}), "logit_bias"),
    (completion(logit_bias={"49152": 1}), "logit_bias"),  # the vocabulary is 49152 tokens
    (completion(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
    (completion(logit_bias=[1]), "logit_bias"),
    (completion(suffix="x"), "suffix"),
    (completion(logprobs=21), "logprobs"),
    (completion(logprobs=-1), "logprobs"),
    (completion(stream_options={"include_usage": True}), "stream_options"),
    (completion(stream="yes"), "stream"),
    (completion(prompt=""), "prompt"),
    (completion(prompt=[]), "prompt"),
    (completion(prompt=[""]), "prompt"),
    (completion(prompt=[[]]), "prompt"),
    (completion(prompt=5), "prompt"),
    (completion(prompt=[1.5, 2]), "prompt"),
    (completion(prompt=[[1, 2], "a"]), "prompt"),
    (completion(prompt=[True]), "prompt"),
    (completion(prompt=[-1]), "prompt"),
    (completion(prompt=[10**9]), "prompt"),
    (completion(prompt=["a"] * 129), "prompt"),
    (completion(max_tokens=CONTEXT), "max_tokens"),
    (completion(prompt=[[1] * 8000], max_tokens=500), "max_tokens"),
    (completion(prompt=[1] * CONTEXT), "prompt"),
    ({"model": MODEL}, "prompt"),
    # ranges (issue 12): values beyond what any node stores, absurd floats, long strings
    (completion(temperature=1e9), "temperature"),
    (completion(temperature=2.01), "temperature"),
    (completion(top_k=2**40), "top_k"),
    (completion(top_k=2**64), "top_k"),
    (completion(top_k=2**64 + 1), "top_k"),
    (completion(max_tokens=10**30), "max_tokens"),
    (completion(logprobs=2**63), "logprobs"),
    (completion(seed=-(2**63) - 1), "seed"),
    (completion(n=2**70), "n"),
    (completion(best_of=-(2**70)), "best_of"),
    (completion(repetition_penalty=3), "repetition_penalty"),
    (completion(presence_penalty=1e308), "presence_penalty"),
    (completion(stop_token_ids=[2**40]), "stop_token_ids"),
    (completion(stop_token_ids=[2**65]), "stop_token_ids[0]"),
    (completion(stop_token_ids=list(range(257))), "stop_token_ids"),
    (completion(stop=["x" * 513]), "stop"),
    (completion(model="m" * 257), "model"),
    (completion(user="u" * 257), "user"),
    (completion(prompt=[[1, 2], [2**64]]), "prompt[1][0]"),
]

BAD_CHATS = [
    ({"model": MODEL}, "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=[]), "messages"),
    (chat(messages=["hi"]), "messages[0]"),
    (chat(messages=[{"content": "hi"}]), "messages[0].role"),
    (chat(messages=[{"role": "user"}]), "messages[0].content"),
    (chat(messages=[{"role": 5, "content": "hi"}]), "messages[0].role"),
    (chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": None}]), "messages[0].content"),
    (chat(messages=USER + [{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[1].content[0]"),
    (chat(max_tokens="ten"), "max_tokens"),
    (chat(max_completion_tokens=0), "max_completion_tokens"),
    (chat(max_completion_tokens=CONTEXT), "max_completion_tokens"),
    (chat(max_tokens=CONTEXT), "max_tokens"),
    (chat(messages=[{"role": "user", "content": "hello " * CONTEXT}]), "messages"),
    (chat(temperature="hot"), "temperature"),
    (chat(temperature=-0.5), "temperature"),
    (chat(top_p=-1), "top_p"),
    (chat(n=17), "n"),
    (chat(n=-1), "n"),
    (chat(logit_bias={"x1": 1}), "logit_bias"),
    (chat(max_tokens=4, min_tokens=5), "min_tokens"),
    (chat(max_tokens=0, prompt_logprobs=1), "max_tokens"),  # scoring is /v1/completions' only
    (chat(logprobs=1), "logprobs"),
    (chat(top_logprobs=5), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=25), "top_logprobs"),
    (chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(response_format={"type": "yaml"}), "response_format.type"),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (chat(guided_regex="a", guided_choice=["b"]), "guided_choice"),
    (chat(stop=""), "stop"),
    (chat(messages=USER * 4097), "messages"),
    (chat(messages=[{"role": "r" * 300, "content": "hi"}]), "messages[0].role"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 4097}]),
     "messages[0].content"),
    (chat(top_logprobs=2**64 + 5, logprobs=True), "top_logprobs"),
    (chat(max_completion_tokens=2**63), "max_completion_tokens"),
    (chat(temperature=1e9), "temperature"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
async def test_bad_completion_is_400_naming_field(router, http, body, param):
    status, got, headers = await post(http, router + "/v1/completions", body)
    assert_error(status, got, 400, param)
    assert headers["x-request-id"]


@pytest.mark.parametrize("body,param", BAD_CHATS)
async def test_bad_chat_is_400_naming_field(router, http, body, param):
    status, got, _ = await post(http, router + "/v1/chat/completions", body)
    assert_error(status, got, 400, param)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b'{"prompt": ', b"[1, 2]", b'"text"', b"", b"\xff\xfe",
                                 b'{"a": 1e999}', b"null"])
async def test_malformed_body_is_400(router, http, path, raw):
    status, got, _ = await post(http, router + path, raw)
    assert_error(status, got, 400, None)


@pytest.mark.parametrize("path,body", [("/v1/completions", completion(model="gpt-4")),
                                       ("/v1/chat/completions", chat(model="gpt-4"))])
async def test_unknown_model_is_404(router, http, path, body):
    status, got, _ = await post(http, router + path, body)
    assert_error(status, got, 404, "model", code="model_not_found")
    assert "gpt-4" in got["error"]["message"]


async def test_body_over_limit_is_413(router, http):
    big = completion(prompt="a" * (2 << 20))
    status, got, headers = await post(http, router + "/v1/completions", big,
                                      headers={"x-request-id": "big-1"})
    assert_error(status, got, 413, None)
    assert headers["x-request-id"] == "big-1"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", completion()),
    ("/v1/completions", completion(prompt=["a", "b"], stream=True)),
    ("/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True})),
    ("/v1/chat/completions", {"messages": USER}),  # model may be left out
])
async def test_valid_request_without_decode_node_is_503(router, http, path, body):
    status, got, _ = await post(http, router + path, body)
    assert_error(status, got, 503, None, code="no_decode_node")
    assert "no decode node is registered" in got["error"]["message"]


async def test_request_id_is_echoed_or_minted(router, http):
    _, _, headers = await post(http, router + "/v1/completions", completion(n=2),
                               headers={"x-request-id": "client-id-7"})
    assert headers["x-request-id"] == "client-id-7"
    ids = set()
    for path in ("/health", "/v1/models", "/metrics", "/no/such/path"):
        async with http.get(router + path) as resp:
            ids.add(resp.headers["x-request-id"])
    assert len(ids) == 4 and all(len(i) == 32 for i in ids)


async def test_unknown_path_and_method_get_json_errors(router, http):
    async with http.get(router + "/v2/nothing") as resp:
        assert_error(resp.status, await resp.json(), 404, None)
    async with http.get(router + "/v1/completions") as resp:
        assert_error(resp.status, await resp.json(), 405, None)


async def test_models(router, http, client):
    async with http.get(router + "/v1/models") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == CONTEXT
    listed = await client.models.list()
    assert [m.id for m in listed.data] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4")


async def test_health_without_nodes_is_503(router, http):
    async with http.get(router + "/health") as resp:
        assert resp.status == 503
        body = await resp.json()
    assert body == {"status": "no_decode_node", "prefill_nodes": 0, "decode_nodes": 0,
                    "colocated_nodes": 0, "redis": "ok"}


async def test_metrics_count_requests_by_status(router, http):
    await post(http, router + "/v1/completions", completion(temperature="hot"))
    await post(http, router + "/v1/completions", completion())
    async with http.get(router + "/metrics") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        text = await resp.text()
    for name in (names.TIME_TO_FIRST_TOKEN, names.INTER_TOKEN_LATENCY, names.E2E_REQUEST_LATENCY,
                 names.PROMPT_TOKENS, names.GENERATION_TOKENS, names.DELIVERED_CACHED_TOKENS,
                 names.ROUTING_DECISIONS, names.REDIS_ERRORS, names.ROUTER_NODES):
        assert f"# TYPE {name} " in text or f"# TYPE {name}_count " in text, name
    assert sample_sum(text, names.ROUTER_NODES, role="decode") == 0

    def count(status: str) -> float:
        return sample_sum(text, names.HTTP_REQUESTS, endpoint="/v1/completions", status=status)

    assert count("400") >= 1 and count("503") >= 1


# -- the official openai client ----------------------------------------------------


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens="ten"), "max_tokens"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=1.5, top_p=0.0), "top_p"),
    (dict(n=17), "n"),
    (dict(best_of=2), "best_of"),
    (dict(logit_bias={"1": 200}), "logit_bias"),
    (dict(extra_body={"min_tokens": 20}), "min_tokens"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=[[]]), "prompt"),
    (dict(max_tokens=CONTEXT), "max_tokens"),
    (dict(stop=["a"] * 17), "stop"),
    (dict(extra_body={"top_k": -3}), "top_k"),
])
async def test_openai_client_completion_errors(client, kwargs, param):
    kwargs = {"model": MODEL, "prompt": "Hello", **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(**kwargs)
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == param
    assert exc.value.body["type"] == "invalid_request_error"
    assert exc.value.response.headers["x-request-id"]


@pytest.mark.parametrize("kwargs,param", [
    (dict(messages="hi"), "messages"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "user"}]), "messages[0].content"),
    (dict(messages=[{"content": "x"}]), "messages[0].role"),
    (dict(max_completion_tokens=0), "max_completion_tokens"),
    (dict(max_tokens=CONTEXT + 1), "max_tokens"),
    (dict(frequency_penalty=9), "frequency_penalty"),
    (dict(top_logprobs=3), "top_logprobs"),
    (dict(n=40, stream=True), "n"),
    (dict(logit_bias={"abc": 1}), "logit_bias"),
])
async def test_openai_client_chat_errors(client, kwargs, param):
    kwargs = {"model": MODEL, "messages": USER, **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(**kwargs)
    assert exc.value.body["param"] == param


async def test_openai_client_unknown_model_and_no_node(client):
    with pytest.raises(openai.NotFoundError) as exc:
        await client.chat.completions.create(model="gpt-4", messages=USER)
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.APIStatusError) as exc:
        await client.chat.completions.create(model=MODEL, messages=USER, stream=True)
    assert exc.value.status_code == 503
    with pytest.raises(openai.APIStatusError) as exc:
        await client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=4)
    assert exc.value.status_code == 503


async def test_openai_client_body_over_limit_is_413(client):
    with pytest.raises(openai.APIStatusError) as exc:
        await client.completions.create(model=MODEL, prompt="a" * (2 << 20))
    assert exc.value.status_code == 413
