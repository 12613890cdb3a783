"""The unknown-field rule (router/openai/request_fields.py) on /v1/chat/completions,
/v1/completions and /v1/responses: a field nobody defines is a 400 with OpenAI's body
("Unrecognized request argument supplied: <field>", param the field); fields that do
not change the output are accepted; fields that would, and cannot be honoured, are a
400 naming them unless inert. The official openai client with every common option of
each endpoint gets past validation (here: the 503 of a router without decode nodes),
and every field of the client's request types is covered by the rule."""

import json
import typing

import aiohttp
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from splitserve.router.openai.structs import ChatCompletionRequest, CompletionRequest
from splitserve.router.openai.request_fields import ENDPOINTS
from splitserve.router.responses.request import ResponsesRequest
from splitserve.router.app import start_router
from splitserve.router.config import RouterConfig

MODEL = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "Hi"}]
BODIES = {"/v1/chat/completions": {"model": MODEL, "messages": USER},
          "/v1/completions": {"model": MODEL, "prompt": "Hi"},
          "/v1/responses": {"model": MODEL, "input": "Hi"}}
CLIENT_TYPES = {"chat": (chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest),
                "completion": (completion_create_params.CompletionCreateParamsBase, CompletionRequest),
                "responses": (response_create_params.ResponseCreateParamsBase, ResponsesRequest)}


@pytest.mark.parametrize("endpoint", list(CLIENT_TYPES))
def test_every_field_of_the_openai_client_is_read_ignored_or_refused(endpoint):
    client_type, struct = CLIENT_TYPES[endpoint]
    spec = set(typing.get_type_hints(client_type)) | {"stream"}
    ignored, refused = ENDPOINTS[endpoint]
    declared = set(struct.__struct_fields__)
    assert spec - declared - ignored - set(refused) == set()
    assert not (ignored & set(refused)) and not (declared & set(refused))


@pytest.fixture(scope="module")
async def router(redis_url):
    running = await start_router(RouterConfig(host="127.0.0.1", port=0, redis_url=redis_url))
    yield running.url
    await running.stop()


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, data=json.dumps(body), headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


@pytest.mark.anyio
@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("field", ["surely_not_a_field", "max_completion_token", "guided_regx",
                                   "Temperature"])
async def test_unknown_field_is_400_as_openai(router, http, path, field):
    status, body = await post(http, router + path, {**BODIES[path], field: 1})
    assert status == 400
    assert body == {"error": {"message": f"Unrecognized request argument supplied: {field}",
                              "type": "invalid_request_error", "param": field, "code": None}}


@pytest.mark.anyio
@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/chat/completions", "use_beam_search", True),
    ("/v1/chat/completions", "skip_special_tokens", False),
    ("/v1/completions", "prompt_embeds", "AAAA"),
    ("/v1/completions", "truncate_prompt_tokens", 4),
    ("/v1/responses", "background", True),
    ("/v1/responses", "conversation", "conv_1"),
    ("/v1/responses", "truncation", "auto"),
    ("/v1/responses", "prompt", {"id": "pmpt_1"}),
])
async def test_fields_that_cannot_be_honoured_are_400_naming_them(router, http, path, field, value):
    status, body = await post(http, router + path, {**BODIES[path], field: value})
    assert status == 400 and body["error"]["param"] == field, body
    assert body["error"]["message"].startswith(f"{field}: ")


@pytest.mark.anyio
@pytest.mark.parametrize("path, fields", [
    ("/v1/chat/completions", {"metadata": {"k": "v"}, "store": True, "service_tier": "auto",
                              "prompt_cache_key": "k", "safety_identifier": "u1", "user": "u",
                              "reasoning_effort": "low", "verbosity": "low", "modalities": ["text"],
                              "audio": None, "prediction": {"type": "content", "content": "x"},
                              "skip_special_tokens": True, "priority": 1, "request_id": "r",
                              "guided_decoding_backend": "xgrammar", "length_penalty": 1.0,
                              "chat_template_kwargs": {"enable_thinking": False}}),
    ("/v1/completions", {"user": "u", "add_special_tokens": False, "priority": 0,
                         "spaces_between_special_tokens": True, "guided_choice": ["a", "b"]}),
    ("/v1/responses", {"metadata": {"k": "v"}, "store": False, "service_tier": "default",
                       "prompt_cache_key": "k", "prompt_cache_retention": "24h",
                       "safety_identifier": "u1", "user": "u", "truncation": "disabled",
                       "background": False, "max_tool_calls": 3, "include": [],
                       "reasoning": {"effort": "low"}, "top_k": 5, "seed": 1,
                       "repetition_penalty": 1.1, "priority": 2}),
])
async def test_fields_that_change_nothing_are_accepted(router, http, path, fields):
    status, body = await post(http, router + path, {**BODIES[path], **fields})
    assert status == 503 and body["error"]["code"] == "no_decode_node", body  # past every check


TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}


@pytest.mark.anyio
async def test_the_openai_client_with_every_common_option_passes(router):
    """The client sends only spec fields: none of them is refused."""
    async with openai.AsyncOpenAI(base_url=router + "/v1", api_key="-", max_retries=0) as client:
        calls = [
            client.chat.completions.create(
                model=MODEL, messages=USER, frequency_penalty=0.1, presence_penalty=0.1,
                logit_bias={"42": 1}, logprobs=True, top_logprobs=2, max_completion_tokens=8,
                n=2, seed=3, stop=["\n\n"], temperature=0.5, top_p=0.9, tools=[TOOL],
                tool_choice="auto", parallel_tool_calls=True, user="u", metadata={"k": "v"},
                store=False, service_tier="auto", prompt_cache_key="p", safety_identifier="s",
                reasoning_effort="low", verbosity="low", modalities=["text"],
                prediction={"type": "content", "content": "Hi"}, stream=True,
                stream_options={"include_usage": True}),
            client.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "o", "schema": {"type": "object"}, "strict": True}}),
            client.completions.create(
                model=MODEL, prompt="Hi", best_of=1, echo=True, frequency_penalty=0.1,
                logit_bias={"42": 1}, logprobs=2, max_tokens=8, n=1, presence_penalty=0.1, seed=1,
                stop="\n", temperature=0.5, top_p=0.9, user="u"),
            client.responses.create(
                model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                instructions="Be brief.", max_output_tokens=8, temperature=0.5, top_p=0.9,
                tools=[{"type": "function", "name": "f", "parameters": TOOL["function"]["parameters"],
                        "strict": True}],
                tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
                reasoning={"effort": "low"}, include=["message.output_text.logprobs"],
                top_logprobs=2, store=True, metadata={"k": "v"}, user="u", service_tier="auto",
                prompt_cache_key="p", safety_identifier="s", truncation="disabled",
                max_tool_calls=2, background=False),
            client.responses.create(
                model=MODEL, input="Hi", stream=True, text={"format": {
                    "type": "json_schema", "name": "o", "schema": {"type": "object"}, "strict": True},
                    "verbosity": "low"}),
        ]
        for call in calls:
            with pytest.raises(openai.APIStatusError) as exc:
                await call
            assert exc.value.status_code == 503, exc.value.body
