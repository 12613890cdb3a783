"""Every bad input on POST /v1/responses is a 400 naming the field, with OpenAI's error
body (the real router app, a real redis-server, no nodes: a valid request would be a
503); GET / DELETE of an unknown response are 404s; field renames from the chat path
(max_completion_tokens -> max_output_tokens, ...) hold."""

import json
import logging

import openai
import pytest

from splitserve.router.app import start_router
from splitserve.router.config import RouterConfig
from splitserve.router.responses.prepare import responses_field

pytestmark = pytest.mark.anyio

MODEL = "SmolLM2-135M-Instruct"
FN = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}


def body(**fields) -> dict:
    return {"model": MODEL, "input": "Hi", **fields}


BAD = [
    (body(input=5), "input"),
    (body(input=[]), "input"),
    (body(input=["x"]), "input[0]"),
    (body(input=[{}]), "input[0].type"),
    (body(input=[{"type": "web_search_call", "id": "ws_1"}]), "input[0].type"),
    (body(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type"),
    (body(input=[{"role": "user", "content": "a"}, {"type": 7}]), "input[1].type"),
    (body(input=[{"role": "wizard", "content": "x"}]), "input[0].role"),
    (body(input=[{"role": "user"}]), "input[0].content"),
    (body(input=[{"role": "user", "content": 5}]), "input[0].content"),
    (body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
     "input[0].content[0]"),
    (body(input=[{"role": "user", "content": [{"type": "input_text"}]}]), "input[0].content[0]"),
    (body(input=[{"role": "user", "content": [{"text": "a"}]}]), "input[0].content[0].type"),
    (body(input=[{**CALL, "arguments": None}]), "input[0].arguments"),
    (body(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input[0].call_id"),
    (body(input=[{"type": "function_call_output", "call_id": "call_9", "output": "x"}]), "input[0].call_id"),
    (body(input=[{"type": "function_call_output", "call_id": "call_1", "output": "x"}, CALL]),
     "input[0].call_id"),  # an output before its call
    (body(input=[CALL, {"type": "function_call_output", "output": "x"}]), "input[1].call_id"),
    (body(input=[CALL, {"type": "function_call_output", "call_id": "call_1", "output": 3}]), "input[1].output"),
    (body(input=[{"role": "user", "content": "a"}] * 4097), "input"),
    (body(input="hello " * 9000), "input"),  # longer than the model's context
    (body(instructions=5), "instructions"),
    (body(max_output_tokens=0), "max_output_tokens"),
    (body(max_output_tokens="8"), "max_output_tokens"),
    (body(max_output_tokens=9000), "max_output_tokens"),
    (body(temperature="hot"), "temperature"),
    (body(temperature=-1), "temperature"),
    (body(top_p=1.5), "top_p"),
    (body(top_k=-5), "top_k"),
    (body(seed="x"), "seed"),
    (body(top_logprobs=21), "top_logprobs"),
    (body(include="message.output_text.logprobs"), "include"),
    (body(tools={"type": "function"}), "tools"),
    (body(tools=[{"type": "web_search"}]), "tools[0].type"),
    (body(tools=[{"type": "function", "parameters": {}}]), "tools[0].name"),
    (body(tools=[{**FN, "parameters": 5}]), "tools[0].parameters"),
    (body(tools=[FN, FN]), "tools[1].name"),
    (body(tools=[FN], tool_choice="sometimes"), "tool_choice"),
    (body(tools=[FN], tool_choice={"type": "function", "name": "other"}), "tool_choice.name"),
    (body(tools=[FN], tool_choice={"type": "function"}), "tool_choice.name"),
    (body(tools=[FN], tool_choice={"type": "file_search"}), "tool_choice.type"),
    (body(tool_choice="required"), "tool_choice"),
    (body(text="json"), "text"),
    (body(text={"format": {"type": "xml"}}), "text.format.type"),
    (body(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
    (body(text={"format": {"type": "json_schema", "name": "x", "schema": {}, "colour": 1}}),
     "text.format.colour"),
    (body(text={"format": {"type": "json_schema", "name": 5, "schema": {}}}), "text.format.name"),
    (body(text={"format": {"type": "json_object"}}, tools=[FN], tool_choice="required"), "text.format"),
    (body(reasoning=5), "reasoning"),
    (body(metadata={"k": 5}), "metadata[...]"),  # msgspec names a value of a map so
    (body(store="yes"), "store"),
    (body(stream="yes"), "stream"),
    (body(stream_options={"include_obfuscation": False}), "stream_options"),
    (body(parallel_tool_calls="no"), "parallel_tool_calls"),
    (body(previous_response_id="resp_unknown"), "previous_response_id"),
    (body(previous_response_id=5), "previous_response_id"),
    (body(surely_not_a_field=1), "surely_not_a_field"),
]


@pytest.fixture(scope="module")
async def router(redis_url):
    running = await start_router(RouterConfig(host="127.0.0.1", port=0, redis_url=redis_url))
    yield running.url
    await running.stop()


@pytest.fixture(autouse=True)
def no_unexpected_errors(caplog):
    with caplog.at_level(logging.ERROR, logger="splitserve.router"):
        yield
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def post(http, url: str, data: dict) -> tuple[int, dict]:
    async with http.post(url, data=json.dumps(data), headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("data, param", BAD, ids=[p for _, p in BAD])
async def test_bad_input_is_400_naming_the_field(router, http, data, param):
    status, answer = await post(http, router + "/v1/responses", data)
    assert status == 400, answer
    err = answer["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert param.split("[")[0].split(".")[0] in err["message"]


async def test_valid_request_gets_past_every_check(router, http):
    """A valid request with items of every kind reaches routing: 503 without a node."""
    data = body(instructions="Be brief.", tools=[FN], tool_choice="auto", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {**CALL, "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "sun"}]},
        {"role": "developer", "content": "Answer in one word."}])
    status, answer = await post(http, router + "/v1/responses", data)
    assert status == 503 and answer["error"]["code"] == "no_decode_node", answer


async def test_unknown_model_is_404(router, http):
    status, answer = await post(http, router + "/v1/responses", body(model="gpt-5"))
    assert status == 404 and answer["error"]["param"] == "model"


async def test_get_and_delete_of_an_unknown_response_are_404(router):
    async with openai.AsyncOpenAI(base_url=router + "/v1", api_key="-", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_nope")
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete("resp_nope")
        with pytest.raises(openai.BadRequestError) as exc:
            await client.responses.create(model=MODEL, input="Hi", max_output_tokens=-1)
        assert exc.value.body["param"] == "max_output_tokens"


@pytest.mark.parametrize("chat, responses", [
    ("max_completion_tokens", "max_output_tokens"), ("messages", "input"), ("messages[3]", "input"),
    ("response_format.json_schema.schema", "text.format.schema"), ("response_format.type", "text.format.type"),
    ("tools[2].function.parameters", "tools[2].parameters"), ("tool_choice.function.name", "tool_choice.name"),
    ("temperature", "temperature"), ("tools", "tools")])
def test_chat_fields_are_renamed(chat, responses):
    assert responses_field(chat) == responses
