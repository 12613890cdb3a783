"""The body of ``POST /v1/responses`` (OpenAI's Responses API), as msgspec structs.

Owns the fields the router reads and their JSON types, and the shapes of the input
items it understands::

    input: "text"                                 one user message
         | [item, ...]   message        {"role", "content": str | [text part]}
                         function_call  {"call_id", "name", "arguments"}  (an earlier turn's)
                         function_call_output {"call_id", "output"}
                         reasoning      dropped (the models served here do not reason)
    text part: {"type": "input_text" | "output_text", "text"} | {"type": "refusal", "refusal"}

Items are read one by one (`parse_items`) so that an error names ``input[i].<field>``.
Which other top-level fields are accepted, dropped or refused is request_fields.py's.
The sampling extensions (vLLM: ``top_k``, ``seed``, ...) are passed on to the chat
request as they are, and checked there (responses/prepare.py).

Must not render, tokenize or know about nodes.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ..errors import ApiError
from ..openai.structs import MAX_MESSAGES, MAX_NAME_CHARS, MAX_TOOLS, CacheSaltField, Name
from ..openai.request_fields import field_error

MAX_METADATA = 16  # OpenAI's limit on metadata pairs
# Sampling fields of the chat request that /v1/responses passes on unchanged (vLLM's extensions
# and the spec's penalties); each keeps its chat name and check.
SAMPLING_EXTRAS = ("top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "logit_bias", "stop", "stop_token_ids", "ignore_eos",
                   "min_tokens", "include_stop_str_in_output")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class TextConfig(msgspec.Struct, kw_only=True):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: str | None = None  # a hint to OpenAI's models: accepted, unused


class Reasoning(msgspec.Struct, kw_only=True):
    """Accepted and ignored: the models served here do not reason."""
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(msgspec.Struct, kw_only=True):
    include_obfuscation: bool = True  # accepted, unused


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_MESSAGES)]
    model: Name | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    include: Annotated[list[Name], msgspec.Meta(max_length=64)] | None = None
    top_logprobs: int | None = None
    store: bool | None = None  # default true, as OpenAI's
    previous_response_id: Name | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    metadata: Annotated[dict[str, str], msgspec.Meta(max_length=MAX_METADATA)] | None = None
    user: Name | None = None
    cache_salt: CacheSaltField | None = None  # extension (vLLM): passed on to the chat request
    # passed on to the chat request (SAMPLING_EXTRAS), typed and checked there
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    min_tokens: Any = None
    include_stop_str_in_output: Any = None


# -- input items ---------------------------------------------------------------------


class TextPart(msgspec.Struct, kw_only=True):
    type: Name
    text: str | None = None
    refusal: str | None = None


class MessageItem(msgspec.Struct, kw_only=True):
    role: Name
    content: str | Annotated[list[TextPart], msgspec.Meta(max_length=MAX_MESSAGES)]


class FunctionCallItem(msgspec.Struct, kw_only=True):
    call_id: Name
    name: Name
    arguments: str


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    call_id: Name | None = None
    output: str | Annotated[list[TextPart], msgspec.Meta(max_length=MAX_MESSAGES)]


class FunctionTool(msgspec.Struct, kw_only=True):
    type: Name
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def parse_items(items: list[dict[str, Any]], where: str, calls: set[str]) -> list[dict[str, Any]]:
    """Input items -> the normalized items this router keeps (each a valid input item
    itself): ``{"type": "message", "role", "content": str}``, ``{"type": "function_call",
    "call_id", "name", "arguments"}``, ``{"type": "function_call_output", "call_id",
    "output": str}``; reasoning items are dropped. 400 naming ``<where>[i].<field>``.
    ``calls``: the call ids of the conversation's function_call items so far (a
    function_call_output must answer one of them); this input's are added."""
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        path = f"{where}[{i}]"
        if not isinstance(raw, dict):
            raise ApiError(400, f"{path}: must be an object (an input item)", param=path)
        kind = raw.get("type", "message" if "role" in raw else None)
        if kind == "message":
            msg = _convert(raw, MessageItem, path)
            if msg.role not in ROLES:
                raise ApiError(400, f"{path}.role: must be one of {', '.join(ROLES)}, got "
                               f"{msg.role[:MAX_NAME_CHARS]!r}", param=f"{path}.role")
            out.append({"type": "message", "role": msg.role,
                        "content": _text(msg.content, f"{path}.content", msg.role == "assistant")})
        elif kind == "function_call":
            call = _convert(raw, FunctionCallItem, path)
            calls.add(call.call_id)
            out.append({"type": "function_call", "call_id": call.call_id, "name": call.name,
                        "arguments": call.arguments})
        elif kind == "function_call_output":
            result = _convert(raw, FunctionCallOutputItem, path)
            if result.call_id is None:
                raise ApiError(400, f"{path}.call_id: required: the call_id of the function_call "
                               "this output answers", param=f"{path}.call_id")
            if result.call_id not in calls:
                raise ApiError(400, f"{path}.call_id: no function_call with call_id "
                               f"{result.call_id!r} precedes this output in the conversation",
                               param=f"{path}.call_id")
            out.append({"type": "function_call_output", "call_id": result.call_id,
                        "output": _text(result.output, f"{path}.output", False)})
        elif kind == "reasoning":
            continue
        else:
            shown = repr(kind)[:MAX_NAME_CHARS] if kind is not None else "none"
            raise ApiError(400, f"{path}.type: unsupported input item type {shown}; supported: "
                           + ", ".join(ITEM_TYPES), param=f"{path}.type")
    return out


def parse_tools(tools: list[dict[str, Any]]) -> list[FunctionTool]:
    """Function tools; any other tool type is a 400 naming ``tools[i].type``."""
    out = []
    for i, raw in enumerate(tools):
        path = f"tools[{i}]"
        if not isinstance(raw, dict):
            raise ApiError(400, f"{path}: must be an object (a tool)", param=path)
        if raw.get("type") != "function":
            shown = repr(raw.get("type"))[:MAX_NAME_CHARS]
            raise ApiError(400, f"{path}.type: only function tools are supported, got {shown}",
                           param=f"{path}.type")
        out.append(_convert(raw, FunctionTool, path))
    return out


def _convert(raw: dict[str, Any], type_: type, path: str) -> Any:
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as e:
        err = field_error(e)
        field = f"{path}.{err.field}" if err.field != "body" else path
        raise ApiError(400, f"{field}: {err.message}", param=field) from None


def _text(content: str | list[TextPart], path: str, refusals: bool) -> str:
    """A message's content as one string: the text parts joined."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in _TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and refusals and part.refusal is not None:
            texts.append(part.refusal)
        else:
            raise ApiError(400, f"{path}[{j}]: only text parts ({{\"type\": \"input_text\", "
                           f"\"text\": ...}}) are supported, got type {part.type[:MAX_NAME_CHARS]!r}",
                           param=f"{path}[{j}]")
    return "".join(texts)
