"""Structured outputs and tool calling through the official openai client, on a real
router, prefill node and decode node serving the bundled SmolLM2 (the prefill node
samples the first token under the grammar, the decode node the rest).

- response_format json_schema: every answer of a concurrent batch parses and validates
  against the schema (the 100-request run is benchmarks/engine/bench_structured.py --check);
- json_object: parseable JSON objects; vLLM's guided_choice / guided_regex /
  structured_outputs on /v1/completions;
- tool_choice named / required: valid calls (streamed and whole), auto: a parser;
- bad schemas and conflicting parameters: 400 naming the field; no block leaks.
"""

import asyncio
import json
import re
import urllib.request

import jsonschema
import openai
import pytest

from splitserve.deploy.launcher import Cluster
from splitserve.tests.metrics_text import sample_sum

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
          "properties": {"city": {"type": "string", "maxLength": 20},
                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                   "properties": {"timezone": {"type": "string", "maxLength": 24}}}}}
ASK = [{"role": "user", "content": "Name a city and its population, as JSON."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def cluster():
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory="64MiB") as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=180)


def metric(cluster: Cluster, name: str, metric_name: str) -> float:
    with urllib.request.urlopen(f"{cluster.node(name).addr}/metrics", timeout=10) as r:
        return sample_sum(r.read().decode(), metric_name)


def test_json_schema_batch_all_valid(cluster):
    """8 concurrent sampled answers, all valid against the schema, every first token
    sampled on the prefill node (no local fallback)."""
    fallbacks = metric(cluster, "decode-0", "splitserve:decode_fallback_prefills_total")
    aclient = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=180)

    async def one(i):
        return await aclient.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=48, temperature=1.0, seed=i,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})

    async def run():
        try:
            return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            await aclient.close()

    answers = asyncio.run(run())
    for a in answers:
        assert a.choices[0].finish_reason == "stop", a.choices[0]
        jsonschema.validate(json.loads(a.choices[0].message.content), SCHEMA)
    assert len({a.choices[0].message.content for a in answers}) > 1  # sampled, not one greedy answer
    assert metric(cluster, "decode-0", "splitserve:decode_fallback_prefills_total") == fallbacks


def test_json_object_and_streaming(client):
    whole = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=32, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}])
    assert whole.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    chunks = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=48, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    plain = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=4,
                                           temperature=0, response_format={"type": "text"})
    assert plain.choices[0].message.content


def test_vllm_extras_on_completions(client):
    choice = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Is the sky blue? Answer:",
                                       max_tokens=8, temperature=1.0, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"
    regex = client.completions.create(model="SmolLM2-135M-Instruct", prompt="A phone number:", max_tokens=16,
                                      extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].text)
    so = client.completions.create(model="SmolLM2-135M-Instruct", prompt="City data:", max_tokens=48,
                                   temperature=0, extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(so.choices[0].text), SCHEMA)


def test_named_tool_choice_whole_and_streamed(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=WEATHER_ASK, max_tokens=48,
                                            temperature=0.7, seed=3, tools=[WEATHER, TIME], tool_choice=named)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=WEATHER_ASK, max_tokens=48, temperature=0, stream=True,
        tools=[WEATHER, TIME], tool_choice=named))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_choice_gives_valid_calls(client):
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for stream in (False, True):
        kwargs = dict(model="SmolLM2-135M-Instruct", messages=WEATHER_ASK, max_tokens=64, temperature=0.7,
                      seed=5, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            calls, finish = choice.message.tool_calls, choice.finish_reason
        assert finish == "tool_calls" and len(calls) == 1
        assert calls[0].function.name in tools
        jsonschema.validate(json.loads(calls[0].function.arguments), tools[calls[0].function.name])


def test_auto_and_none_tool_choice(client):
    for choice in ("auto", "none"):
        answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=WEATHER_ASK, max_tokens=32,
                                                temperature=0, tools=[WEATHER], tool_choice=choice).choices[0]
        if answer.message.tool_calls:  # auto: the model chose to call
            assert choice == "auto" and answer.finish_reason == "tool_calls"
            json.loads(answer.message.tool_calls[0].function.arguments)
        else:
            assert answer.message.content and "<tool_call>" not in answer.message.content or choice == "auto"


@pytest.mark.parametrize("kwargs, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "yaml"}), "response_format.type"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}), "guided_regex"),
    (dict(extra_body={"guided_regex": "(("}), "guided_regex"),
    (dict(extra_body={"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}), "structured_outputs"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": "x"}}}}}], tool_choice="required"), "tools"),
])
def test_bad_structured_requests_are_400(client, cluster, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=8, **kwargs)
    assert err.value.body["param"] == param, err.value.body
    assert err.value.body["message"].startswith(param)
    with urllib.request.urlopen(f"{cluster.node('decode-0').addr}/health", timeout=10) as r:
        assert r.status == 200  # the node is alive


def test_colocated_node_constrains_too():
    """A colocated node (prefill and decode in one engine) runs the same grammar path."""
    with Cluster(prefill_nodes=0, decode_nodes=1, colocated=True, kv_cache_memory="32MiB") as c:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=180)
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=48, temperature=1.0, seed=7,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
        jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
