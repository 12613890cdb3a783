"""/v1/responses through the official openai client and an agent SDK, on a cluster
started as `splitserve up` starts one (deploy/launcher.py's Cluster: Redis, two router
replicas, a prefill node and a decode node on the bundled SmolLM2):

- plain and streamed: greedy text equal to the chat endpoint's for the same
  conversation, usage exact (input = the chat prompt's tokens, output = the chat's), the
  stream's typed events in order with sequence numbers 0..n-1;
- a function tool, then a follow-up carrying function_call_output: through
  previous_response_id on the other router replica (the Redis store), and stateless with
  every item in input; both equal the chat endpoint's answer to the same messages;
- text.format json_schema (sampled, whole and streamed): valid whenever completed;
- a tool-call list cut by max_tokens: its complete calls, finish_reason "length"
  (chat) / status "incomplete" (responses), streamed and whole;
- openai-agents' Responses-based agent with one function tool, run to completion.
"""

import json
import re
import urllib.request

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from splitserve.deploy.launcher import Cluster

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 24}}}, "strict": True}
PING = {"type": "function", "name": "ping", "description": "Ping the server",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
          "properties": {"city": {"type": "string", "maxLength": 20},
                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}
ASK = "What is the weather like in Paris?"


def chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


@pytest.fixture(scope="module")
def cluster():
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory="64MiB",
                 router_replicas=2) as c:
        yield c


@pytest.fixture(scope="module")
def clients(cluster):
    return [openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=180)
            for url in cluster.urls]


@pytest.fixture(scope="module")
def client(clients):
    return clients[0]


def prompt_tokens(cluster, messages: list[dict]) -> int:
    req = urllib.request.Request(f"{cluster.url}/tokenize", data=json.dumps({"messages": messages}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["count"]


EVENT_ORDER = re.compile(
    r"response\.created response\.in_progress "
    r"((response\.output_item\.added response\.content_part\.added (response\.output_text\.delta )*"
    r"response\.output_text\.done response\.content_part\.done response\.output_item\.done )"
    r"|(response\.output_item\.added (response\.function_call_arguments\.delta )*"
    r"response\.function_call_arguments\.done response\.output_item\.done ))+"
    r"response\.(completed|incomplete)")


def collect(stream) -> tuple[list, object]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert EVENT_ORDER.fullmatch(" ".join(e.type for e in events)), [e.type for e in events]
    return events, events[-1].response


def test_plain_and_streamed_equal_chat_with_exact_usage(cluster, client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Write one sentence about the sea."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    whole = client.responses.create(model=MODEL, instructions="You are terse.",
                                    input="Write one sentence about the sea.", max_output_tokens=24,
                                    temperature=0)
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert whole.usage.input_tokens == chat.usage.prompt_tokens == prompt_tokens(cluster, messages)
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.usage.input_tokens_details.cached_tokens > 0  # the chat request's blocks
    events, final = collect(client.responses.create(
        model=MODEL, instructions="You are terse.", stream=True, max_output_tokens=24, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Write one sentence about the sea."}]}]))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens,
                                                                     whole.usage.output_tokens)
    assert final.status == whole.status and events[0].response.status == "in_progress"
    cut = client.responses.create(model=MODEL, input="Count to twenty.", max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3


def test_function_call_and_follow_up_across_replicas(cluster, clients):
    a, b = clients
    first = a.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                               max_output_tokens=48, temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert "city" in json.loads(call.arguments)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    stored = b.responses.create(model=MODEL, previous_response_id=first.id, input=[result],
                                tools=[WEATHER], tool_choice="none", max_output_tokens=32, temperature=0)
    stateless = a.responses.create(model=MODEL, store=False, tools=[WEATHER], tool_choice="none",
                                   max_output_tokens=32, temperature=0, input=[
                                       {"role": "user", "content": ASK},
                                       {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                        "arguments": call.arguments}, result])
    chat = a.chat.completions.create(model=MODEL, tools=[chat_tool(WEATHER)], tool_choice="none",
                                     max_tokens=32, temperature=0, messages=[
                                         {"role": "user", "content": ASK},
                                         {"role": "assistant", "content": None, "tool_calls": [
                                             {"id": call.call_id, "type": "function",
                                              "function": {"name": call.name, "arguments": call.arguments}}]},
                                         {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}])
    assert stored.output_text == stateless.output_text == chat.choices[0].message.content
    assert stored.output_text and stored.previous_response_id == first.id
    assert stored.usage.input_tokens == stateless.usage.input_tokens == chat.usage.prompt_tokens
    assert b.responses.retrieve(stored.id).output_text == stored.output_text  # stored by replica B
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(stateless.id)  # store=False
    a.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as exc:
        b.responses.create(model=MODEL, previous_response_id=first.id, input=[result], max_output_tokens=4)
    assert exc.value.body["param"] == "previous_response_id"


def test_streamed_function_call(client):
    events, final = collect(client.responses.create(
        model=MODEL, input=ASK, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=48, temperature=0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (call,) = final.output
    assert call.type == "function_call" and call.arguments == deltas
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_is_valid_whenever_completed(client, stream):
    text_format = {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}}
    completed = 0
    for seed in range(4):
        kwargs = dict(model=MODEL, input="Name a city and its population, as JSON.", text=text_format,
                      max_output_tokens=48, temperature=1.0, extra_body={"seed": seed})
        if stream:
            _, response = collect(client.responses.create(stream=True, **kwargs))
        else:
            response = client.responses.create(**kwargs)
        if response.status == "completed":
            completed += 1
            jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert completed >= 2


@pytest.fixture(scope="module")
def no_closing_bracket(bundled_dir) -> dict[str, int]:
    """logit_bias banning every token with a "]": a required call list never closes."""
    tok = Tokenizer.from_file(str(bundled_dir / "tokenizer.json"))
    return {str(i): -100 for i in tok.get_vocab().values() if "]" in tok.decode([i])}


def test_truncated_tool_call_list_chat(client, no_closing_bracket):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Ping the server many times."}],
                  tools=[chat_tool(PING)], tool_choice="required", max_tokens=40, temperature=0,
                  logit_bias=no_closing_bracket)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    assert len(whole.message.tool_calls) >= 2
    assert {(c.function.name, c.function.arguments) for c in whole.message.tool_calls} == {("ping", "{}")}
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls = [c for ch in chunks for d in ch.choices for c in d.delta.tool_calls or ()]
    assert [c.function.name for c in calls] == [c.function.name for c in whole.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not "".join(d.delta.content or "" for ch in chunks for d in ch.choices)


def test_truncated_tool_call_list_responses(client, no_closing_bracket):
    kwargs = dict(model=MODEL, input="Ping the server many times.", tools=[PING], tool_choice="required",
                  max_output_tokens=40, temperature=0, extra_body={"logit_bias": no_closing_bracket})
    whole = client.responses.create(**kwargs)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert len(whole.output) >= 2 and {(o.type, o.name, o.arguments) for o in whole.output} == {
        ("function_call", "ping", "{}")}
    _, final = collect(client.responses.create(stream=True, **kwargs))
    assert final.status == "incomplete" and len(final.output) == len(whole.output)


def test_agent_sdk_runs_a_tool_to_completion(cluster):
    """openai-agents' Responses-based agent: forced to call its one tool first (greedy on the
    tiny model might not), then it answers; the SDK resets tool_choice to auto after the
    call (with plain instructions the tiny model then calls the tool again and again, so
    they tell it to answer once it has the result: greedy, so the run is the same each time)."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="-", max_retries=0,
                                      timeout=180) as aclient:
            agent = Agent(name="weather", instructions="Call get_weather once. When you have its result, "
                          "answer the user in one short sentence and call no more tools.",
                          tools=[get_weather], model=OpenAIResponsesModel(MODEL, aclient),
                          model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48))
            return await Runner.run(agent, ASK, max_turns=4)

    result = asyncio.run(run())
    assert calls == ["Paris"]
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
