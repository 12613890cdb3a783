"""The router's tool-call plumbing on fixed text: tools/tool_choice checks, the forced
call's schema, the parser of each mode, the streamed deltas (whatever the text's split
into pieces), and the tools written into the prompt of a template without tool support."""

import json

import msgspec
import pytest

from splitserve.router.errors import ApiError
from splitserve.router.openai.structs import ChatCompletionRequest
from splitserve.router.openai.tool_calls import ToolCallStream, ToolMode, inline_tools, parse, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def request(**kwargs) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **kwargs}, ChatCompletionRequest)


def test_plans():
    assert plan_tools(request()) is None and plan_tools(request(tool_choice="none")) is None
    assert plan_tools(request(tools=[WEATHER])).mode is ToolMode.AUTO
    none = plan_tools(request(tools=[WEATHER], tool_choice="none"))
    assert none.mode is ToolMode.NONE and none.tools == [] and none.constraint is None
    named = plan_tools(request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}}))
    assert named.named == "get_weather" and json.loads(named.constraint.json) == WEATHER["function"]["parameters"]
    required = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(required.constraint.json)
    assert schema["maxItems"] == 1 and [i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]] == [
        "get_weather", "get_time"]


@pytest.mark.parametrize("kwargs, param", [
    (dict(tool_choice="auto"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "x"}}]), "tools[0].type"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}),
     "tool_choice.function.name"),
])
def test_bad_tools_name_the_field(kwargs, param):
    with pytest.raises(ApiError) as err:
        plan_tools(request(**kwargs))
    assert err.value.status == 400 and err.value.param == param


def test_parse_each_mode():
    auto = plan_tools(request(tools=[WEATHER]))
    content, calls = parse(auto, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                 '</tool_call>')
    assert content == "Let me check." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert parse(auto, "Just text.") == ("Just text.", [])
    assert parse(auto, "<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    required = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"))
    content, calls = parse(required, '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                                     '"arguments": {"city": "Oslo"}}]')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    named = plan_tools(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert parse(named, '{"city": "Rome"}')[1][0].arguments == '{"city": "Rome"}'
    assert parse(named, '{"city": "Ro') == ('{"city": "Ro', [])  # cut by max_tokens: stays text


@pytest.mark.parametrize("split", [1, 3, 7, 100])
def test_auto_stream_holds_back_a_tag_split_across_pieces(split):
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>'
    stream = ToolCallStream(plan_tools(request(tools=[WEATHER])))
    deltas = [d for i in range(0, len(text), split) for d in stream.feed(text[i:i + split])]
    last, finish = stream.finish("stop")
    deltas += last
    assert "".join(d.get("content", "") for d in deltas) == "Sure. "
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert calls[0]["id"].startswith("call_") and json.loads(calls[0]["function"]["arguments"]) == {"city": "Lima"}


def test_auto_stream_of_plain_text_is_all_content():
    stream = ToolCallStream(plan_tools(request(tools=[WEATHER])))
    deltas = stream.feed("a <tool") + stream.feed("s> b <")
    last, finish = stream.finish("stop")
    assert "".join(d["content"] for d in deltas + last) == "a <tools> b <" and finish == "stop"


def test_named_stream_sends_arguments_as_they_come():
    stream = ToolCallStream(plan_tools(request(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})))
    first, second = stream.feed('{"city"'), stream.feed(': "Kyiv"}')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert second[0]["tool_calls"][0]["function"] == {"arguments": ': "Kyiv"}'}
    assert stream.finish("stop") == ([], "tool_calls")


def test_inline_tools_for_a_template_without_them():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "id": "call_1", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    out = inline_tools(messages, plan_tools(request(tools=[WEATHER])).tools)
    assert out[0]["content"].startswith("Be brief.\n\n") and "<tools>" in out[0]["content"]
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert "tool_calls" not in out[2] and "tool_call_id" not in out[3]


def test_a_list_cut_by_max_tokens_keeps_its_complete_calls():
    required = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"))
    cut = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}, {"na'
    content, calls = parse(required, cut, "length")
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert parse(required, '[{"name": "get_weather", "argu', "length") == ('[{"name": "get_weather", "argu', [])
    assert parse(required, cut, "stop") == (cut, [])  # a finished answer must parse whole
    auto = plan_tools(request(tools=[WEATHER]))
    tagged = ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
              '<tool_call>{"name": "get_weather", "arguments": {"ci')
    content, calls = parse(auto, tagged, "length")
    assert content == "Sure." and [json.loads(c.arguments) for c in calls] == [{"city": "Oslo"}]
    assert parse(auto, "Just text, cut", "length") == ("Just text, cut", [])


@pytest.mark.parametrize("split", [1, 5, 1000])
def test_a_streamed_list_cut_by_max_tokens_sends_its_complete_calls(split):
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}, {"name": "get_ti'
    stream = ToolCallStream(plan_tools(request(tools=[WEATHER, TIME], tool_choice="required")))
    deltas = [d for i in range(0, len(text), split) for d in stream.feed(text[i:i + split])]
    last, finish = stream.finish("length")
    assert finish == "length" and not deltas
    (delta,) = last
    assert [c["function"]["name"] for c in delta["tool_calls"]] == ["get_time", "get_time"]
    assert [c["index"] for c in delta["tool_calls"]] == [0, 1]
