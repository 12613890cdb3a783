"""A /v1/responses request -> the chat request it means -> a `PreparedRequest`.

The Responses API runs on the chat path: this module maps the request onto a
`ChatCompletionRequest` and hands it to `prepare_chat_request`, so the chat template,
the tools, the grammar (router/openai/structured.py) and every range check are the chat
endpoint's, and the same prompt generates the same tokens::

    instructions                        -> a system message, first
    input items (after a stored         -> messages: message -> {"role", "content"};
      previous response's, if any)         function_call -> the assistant's tool_calls
                                           (merged into the assistant turn before it);
                                           function_call_output -> {"role": "tool",
                                           "tool_call_id"}; reasoning dropped
    tools [{"type": "function", name,   -> tools [{"type": "function", "function": {...}}]
      parameters, ...}], tool_choice       tool_choice ({"type": "function", "name"} ->
                                           {"type": "function", "function": {"name"}})
    text.format json_schema / json_     -> response_format
      object / text
    max_output_tokens, temperature,     -> max_completion_tokens, temperature, top_p,
      top_p, top_logprobs + include        logprobs / top_logprobs
      "message.output_text.logprobs"
    vLLM's sampling extensions          -> the same chat fields

An error the chat checks raise names the chat field; `renamed` turns it into the
Responses field (max_completion_tokens -> max_output_tokens, response_format ->
text.format, tools[i].function.x -> tools[i].x, messages -> input). A function_call_output
whose call_id answers no function_call of the conversation is a 400 naming it.

Must not do I/O (the stored previous response is fetched by the handler) or know nodes.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import msgspec

from ..errors import ApiError
from ..openai.structs import ChatCompletionRequest
from ..openai.prepare import PreparedRequest, decode_body, prepare_chat_request
from ..openai.request_fields import field_error
from .request import (LOGPROBS_INCLUDE, SAMPLING_EXTRAS, ResponsesRequest, parse_items,
                                parse_tools)
from ..tokenizer import RouterTokenizer

MAX_TOP_LOGPROBS = 20

# chat field (a prefix of an error's param) -> the Responses field
_RENAMES = ((re.compile(r"^messages(\[\d+\])?"), "input"),
            (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
            (re.compile(r"^response_format\.json_schema"), "text.format"),
            (re.compile(r"^response_format"), "text.format"),
            (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
            (re.compile(r"^tool_choice\.function"), "tool_choice"))


class ResponsesPrepared(NamedTuple):
    prep: PreparedRequest  # the chat request's, ready to route
    request: ResponsesRequest
    items: list[dict[str, Any]]  # the conversation so far (stored history + this input)
    logprobs: bool  # output_text parts carry logprobs


def decode_responses(body: bytes) -> ResponsesRequest:
    return decode_body(body, ResponsesRequest, "responses")


def prepare_responses(req: ResponsesRequest, history: list[dict[str, Any]], tok: RouterTokenizer,
                      served: tuple[str, ...], max_model_len: int | None = None) -> ResponsesPrepared:
    """``history``: the normalized items of the stored previous response (its input and
    output), [] without ``previous_response_id``."""
    calls = {item["call_id"] for item in history if item["type"] == "function_call"}
    if isinstance(req.input, str):
        new = [{"type": "message", "role": "user", "content": req.input}]
    else:
        new = parse_items(req.input, "input", calls)
    items = history + new
    if not items:
        raise ApiError(400, "input: must contain at least one item", param="input")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed with stream=true", param="stream_options")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
    logprobs = LOGPROBS_INCLUDE in (req.include or ())
    chat: dict[str, Any] = {"messages": _messages(req.instructions, items), "stream": bool(req.stream)}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "cache_salt", *SAMPLING_EXTRAS):
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if logprobs:
        chat.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters,
            "strict": t.strict}} for t in parse_tools(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    if req.text is not None and req.text.format is not None:
        chat["response_format"] = _response_format(req.text.format)
    try:
        chat_req = msgspec.convert(chat, ChatCompletionRequest)
        prep = prepare_chat_request(chat_req, tok, served, max_model_len)
    except msgspec.ValidationError as e:
        raise renamed(ApiError.invalid(field_error(e))) from None
    except ApiError as e:
        raise renamed(e) from None
    if prep.constraint_field is not None:  # a node's compile error names the user's field
        prep.constraint_field = responses_field(prep.constraint_field)
    return ResponsesPrepared(prep, req, items, logprobs)


def _messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized items -> chat messages (see the module's docstring)."""
    out: list[dict[str, Any]] = [] if instructions is None else [
        {"role": "system", "content": instructions}]
    for item in items:
        kind = item["type"]
        if kind == "message":
            out.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":  # the same assistant turn
                out[-1]["tool_calls"] = [*(out[-1].get("tool_calls") or []), call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]})
    return out


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # none / auto / required: checked by the chat path
    if choice.get("type") != "function":
        shown = repr(choice.get("type"))[:100]
        raise ApiError(400, f"tool_choice.type: only \"function\" is supported (or none, auto, "
                       f"required), got {shown}", param="tool_choice.type")
    name = choice.get("name")
    if not isinstance(name, str):
        raise ApiError(400, "tool_choice.name: required: the function's name", param="tool_choice.name")
    return {"type": "function", "function": {"name": name}}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """text.format -> the chat's response_format (checked there, errors renamed)."""
    if fmt.get("type") != "json_schema":
        return fmt
    spec = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}


def responses_field(field: str) -> str:
    """A chat request's field -> the Responses request's (unchanged when they agree)."""
    for pattern, replacement in _RENAMES:
        new = pattern.sub(replacement, field, count=1)
        if new != field:
            return new
    return field


def renamed(e: ApiError) -> ApiError:
    """A chat path's error, naming the Responses field."""
    if e.param is None or (new := responses_field(e.param)) == e.param:
        return e
    return ApiError(e.status, e.message.replace(e.param, new), param=new, code=e.code,
                    type_=e.type, headers=e.headers)
