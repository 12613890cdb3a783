"""The OpenAI request bodies the router accepts, as msgspec structs.

Owns the fields the router reads and their JSON types; msgspec rejects a wrong type
with the path of the field, which request parsing turns into a 400 naming it. A
top-level field not declared here is either accepted and dropped, refused, or
unrecognized: request_fields.py decides, before these structs see the body. Not
tagged: clients send plain OpenAI JSON.

Lengths are bounded here (msgspec's ``Meta``), so no later message can echo a
megabyte of text back: names and ids to `MAX_NAME_CHARS`, lists of messages and of
content parts to `MAX_MESSAGES`.

Must not check ranges or cross-field rules (prepare.py and `SamplingParams.validate`
do) or know about tokens.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

MAX_NAME_CHARS = 256  # model, user, role, name, content part type
MAX_MESSAGES = 4096  # messages of a chat, and text parts of one message
MAX_TOOLS = 128  # tools of a request, tool calls of a message
MAX_CACHE_SALT_CHARS = 1024  # a cache_salt is an id or a random token, not a document

Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
# vLLM's cache_salt: the request's blocks are hashed with it (non-empty: prepare.py checks)
CacheSaltField = Annotated[str, msgspec.Meta(max_length=MAX_CACHE_SALT_CHARS)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    include_obfuscation: bool = True  # OpenAI's padding of stream events: accepted, unused


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints. None means "not given": the default applies."""

    model: Name | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM)
    min_p: float | None = None  # extension (vLLM)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    ignore_eos: bool = False  # extension (vLLM)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM)
    n: int = 1  # choices per prompt, [1, MAX_N] (prepare.py)
    logit_bias: dict[str, Any] | None = None  # token id (a string) -> bias in [-100, 100]
    min_tokens: int | None = None  # extension (vLLM)
    include_stop_str_in_output: bool = False  # extension (vLLM)
    prompt_logprobs: int | None = None  # extension (vLLM); not with stream
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None  # accepted, unused
    # structured outputs (router/openai/structured.py): at most one of these
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema"}
    structured_outputs: dict[str, Any] | None = None  # extension (vLLM): StructuredOutputsParams fields
    guided_json: str | dict[str, Any] | None = None  # extension (vLLM, older)
    guided_regex: str | None = None  # extension (vLLM, older)
    guided_choice: list[str] | None = None  # extension (vLLM, older)
    guided_grammar: str | None = None  # extension (vLLM, older)
    # extension (vLLM): prefix-cache isolation; combined with the API key's salt (router/api_keys.py)
    cache_salt: CacheSaltField | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a list of token
    ids, or a list of token-id lists (checked in prepare.py)."""

    prompt: str | list[Any]
    logprobs: int | None = None  # sampled token + this many alternatives
    echo: bool = False  # the prompt's text (and, with logprobs, its logprobs) before the completion
    best_of: int | None = None  # only equal to n (or null) is supported
    suffix: str | None = None  # not supported
    add_special_tokens: bool = True  # extension (vLLM): the tokenizer's own (BOS) on a text prompt


class ContentPart(msgspec.Struct, kw_only=True):
    type: Name
    text: str | None = None


class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: Name
    arguments: str  # JSON text, as OpenAI returns it


class ToolCall(msgspec.Struct, kw_only=True):
    """A tool call of an earlier assistant message."""
    id: Name | None = None
    type: Name = "function"
    function: ToolCallFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Name
    # null only for assistant messages
    content: str | Annotated[list[ContentPart], msgspec.Meta(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], msgspec.Meta(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: Name | None = None  # role "tool": the call it answers


class FunctionDef(msgspec.Struct, kw_only=True):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Name  # only "function"
    function: FunctionDef


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: Name


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Name  # only "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[Tool], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Name | NamedToolChoice | None = None  # "none" | "auto" | "required" | a function
    parallel_tool_calls: bool = True  # tool_choice "required": False allows exactly one call
    # extension (vLLM): more variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
