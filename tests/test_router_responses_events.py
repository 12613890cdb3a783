"""The Responses API's objects and streamed events, from chat bodies written by hand:
the order of the events, their sequence numbers, the item ids they share, and every
event and response validated against the openai client's own pydantic types."""

import msgspec
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from splitserve.router.errors import ApiError
from splitserve.router.responses.events import EventStream
from splitserve.router.responses.objects import ResponseHead, output_of, usage_of
from splitserve.router.responses.request import ResponsesRequest

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
USAGE = {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37,
         "prompt_tokens_details": {"cached_tokens": 16}}


def head(**fields) -> ResponseHead:
    return ResponseHead("resp_1", 1700000000, "m", msgspec.convert({"input": "hi", **fields}, ResponsesRequest))


def chunk(content=None, tool_calls=None, finish=None, logprobs=None) -> dict:
    delta = {k: v for k, v in (("content", content), ("tool_calls", tool_calls)) if v is not None}
    return {"choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def run(stream: EventStream, chunks: list[dict]) -> tuple[list[dict], dict]:
    events = stream.start()
    for c in chunks:
        events += stream.chunk(c)
    last, response = stream.finish(usage_of(USAGE))
    events += last
    for e in events:
        EVENT.validate_python(e)
    Response.model_validate(response)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events, response


def test_text_events_in_order():
    events, response = run(EventStream(head(), False), [chunk("Hel"), chunk("lo"), chunk("", finish="stop")])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert {e["item_id"] for e in events[3:8]} == {response["output"][0]["id"]} == {events[8]["item"]["id"]}
    assert events[6]["text"] == "Hello" and response["status"] == "completed"
    assert Response.model_validate(response).output_text == "Hello"
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 16


def test_max_output_tokens_makes_it_incomplete():
    events, response = run(EventStream(head(max_output_tokens=2), False), [chunk("ab", finish="length")])
    assert events[-1]["type"] == "response.incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"


def test_text_then_calls_closes_the_message_first():
    calls = [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    events, response = run(EventStream(head(), False),
                           [chunk("Let me see."), chunk(tool_calls=calls, finish="tool_calls")])
    types = [e["type"] for e in events]
    assert types.index("response.output_item.done") < types.index("response.function_call_arguments.delta")
    assert [o["type"] for o in response["output"]] == ["message", "function_call", "function_call"]
    assert [(o["call_id"], o["arguments"], o["status"]) for o in response["output"][1:]] == [
        ("call_a", '{"x": 1}', "completed"), ("call_b", "{}", "completed")]
    kinds = [e["type"].rsplit(".", 1)[-1] for e in events if "function_call" in e["type"]
             or (e["type"].startswith("response.output_item") and e["item"]["type"] == "function_call")]
    assert kinds == ["added", "delta", "done", "done"] * 2  # each call whole before the next
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["output_index"], e["arguments"]) for e in done] == [(1, '{"x": 1}'), (2, "{}")]


def test_named_call_streams_its_arguments():
    first = [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x"'}}]
    more = [{"index": 0, "function": {"arguments": ": 1}"}}]
    events, response = run(EventStream(head(), False), [chunk(tool_calls=first), chunk(tool_calls=more, finish="tool_calls")])
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"x"', ": 1}"] and response["output"][0]["arguments"] == '{"x": 1}'


def test_logprobs_ride_on_the_text():
    lp = {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]}
    events, response = run(EventStream(head(include=["message.output_text.logprobs"]), True),
                           [chunk("a", logprobs=lp, finish="stop")])
    assert response["output"][0]["content"][0]["logprobs"] == lp["content"]


def test_failure_sends_error_then_failed():
    stream = EventStream(head(), False)
    events = stream.start() + stream.chunk(chunk("x")) + stream.fail(ApiError(502, "decode node died"))
    for e in events:
        EVENT.validate_python(e)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["error"]["message"] == "decode node died"


@pytest.mark.parametrize("finish, status", [("stop", "completed"), ("tool_calls", "completed"),
                                            ("length", "incomplete")])
def test_whole_output_from_a_chat_completion(finish, status):
    message = {"role": "assistant", "content": None if finish == "tool_calls" else "Hi",
               "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
               if finish != "stop" else None}
    output, got = output_of({"choices": [{"index": 0, "message": message, "logprobs": None,
                                          "finish_reason": finish}]})
    assert got == status
    Response.model_validate(head().body(got, output, usage_of(USAGE)))
    kinds = [o["type"] for o in output]
    assert kinds == {"stop": ["message"], "tool_calls": ["function_call"],
                     "length": ["message", "function_call"]}[finish]
