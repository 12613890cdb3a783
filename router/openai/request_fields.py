"""The unknown-field rule: which top-level fields a request body may carry, per endpoint.

    a field the endpoint's struct declares         -> read (openai/structs.py,
                                                      responses/request.py)
    IGNORED: OpenAI's or vLLM's, never changes     -> accepted and dropped
             the output (user ids, caching hints,
             storage flags, scheduling hints)
    REFUSED: would change the output in a way      -> 400 naming it, unless it carries its
             this server cannot honour                inert value (audio off, "text" only, ...)
    anything else                                  -> 400 "Unrecognized request argument
                                                      supplied: <field>", param the field

so a misspelt ``guided_regex`` or ``max_completion_token`` is an error, never a silent
no-op, while the official client libraries (which send only spec fields) always pass.
`tests/test_router_request_fields.py` checks that every field of the openai client's request
types of each endpoint is read, ignored or refused here.

Also owns the one reading of msgspec's validation messages (`field_error`), which every
400 for a wrong JSON type goes through.

Must not check values of the fields it lets through (prepare.py does) or know tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from ...common.errors import InvalidRequest
from ..errors import ApiError
from .json_shape import MAX_KEY_SHOWN

_AT = re.compile(r"^(.*) - at `\$(.*)`$", re.DOTALL)
_MISSING = re.compile(r"missing required field `([^`]+)`")


class Refusal(NamedTuple):
    inert: Callable[[Any], bool]  # the value changes nothing: accepted and dropped
    why: str  # the end of the 400's message


def _none(v: Any) -> bool:
    return v is None


def _falsy(v: Any) -> bool:
    return v is None or v is False


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


# The spec's fields that only concern OpenAI's platform (ids for abuse detection and cache
# bucketing, storage in its dashboard, tiers, metadata) and vLLM's scheduling hints.
_PLATFORM = frozenset({
    "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "safety_identifier", "user", "priority", "request_id",
    "mm_processor_kwargs"})

# vLLM's extensions that are read are declared by the structs (openai/structs.py,
# responses/request.py): top_k, min_p, repetition_penalty, structured_outputs, guided_*,
# chat_template_kwargs, add_special_tokens, ..., and cache_salt on all three endpoints (the
# prefix-cache isolation of router/api_keys.py; a non-string or empty one is a 400 naming it).

# vLLM's sampling and rendering extensions that would change the output, with the value
# that changes nothing (vLLM's default).
_VLLM_REFUSED = {
    "use_beam_search": Refusal(_falsy, "beam search is not supported"),
    "skip_special_tokens": Refusal(_is(True), "special tokens are always skipped"),
    "truncate_prompt_tokens": Refusal(_none, "prompts are never truncated; shorten the prompt"),
    "allowed_token_ids": Refusal(_none, "not supported; use logit_bias or structured_outputs"),
    "bad_words": Refusal(_empty, "not supported; use logit_bias"),
    "guided_whitespace_pattern": Refusal(_none, "not supported; see structured_outputs."
                                         "disable_any_whitespace"),
    "logits_processors": Refusal(_empty, "custom logits processors are not supported"),
    "return_tokens_as_token_ids": Refusal(_falsy, "not supported"),
    "return_token_ids": Refusal(_falsy, "not supported"),
    "kv_transfer_params": Refusal(_none, "splitserve moves KV blocks itself"),
    "vllm_xargs": Refusal(_empty, "not supported"),
}
# vLLM's extensions that never change the output here: beam search only, special tokens
# (always skipped), the structured-output backend (always xgrammar).
_VLLM_IGNORED = frozenset({"length_penalty", "spaces_between_special_tokens",
                           "guided_decoding_backend"})

_CHAT_REFUSED = {
    **_VLLM_REFUSED,
    "audio": Refusal(_none, "audio output is not supported"),
    "modalities": Refusal(_is(["text"]), "only [\"text\"] output is supported"),
    "functions": Refusal(_empty, "deprecated and not supported; use tools"),
    "function_call": Refusal(_none, "deprecated and not supported; use tool_choice"),
    "web_search_options": Refusal(_none, "web search is not supported"),
    "moderation": Refusal(_none, "moderation is not supported"),
    "echo": Refusal(_falsy, "not supported on chat completions"),
    "add_generation_prompt": Refusal(_is(True), "the assistant's turn is always opened"),
    "continue_final_message": Refusal(_falsy, "not supported"),
    "add_special_tokens": Refusal(_falsy, "not supported on chat completions"),
    "chat_template": Refusal(_none, "the model's own chat template is always used"),
    "documents": Refusal(_empty, "not supported"),
    "best_of": Refusal(_is(1), "not supported on chat completions; use n"),
}
_CHAT_IGNORED = _PLATFORM | _VLLM_IGNORED | {
    "prediction",  # predicted outputs only speed generation up
    "reasoning_effort", "verbosity",  # hints; the models served here do not reason
}

_COMPLETION_REFUSED = {
    **_VLLM_REFUSED,
    "prompt_embeds": Refusal(_none, "prompts as embeddings are not supported"),
}
_COMPLETION_IGNORED = _PLATFORM | _VLLM_IGNORED

_RESPONSES_REFUSED = {
    "background": Refusal(_falsy, "background responses are not supported"),
    "conversation": Refusal(_none, "conversations are not supported; use previous_response_id "
                            "or send the items in input"),
    "prompt": Refusal(_none, "prompt templates are not supported; send instructions and input"),
    "truncation": Refusal(_is("disabled"), "only \"disabled\" is supported: an input too long "
                          "for the context is a 400"),
    "moderation": Refusal(_none, "moderation is not supported"),
    "context_management": Refusal(_empty, "context compaction is not supported"),
    "enable_response_messages": Refusal(_falsy, "not supported"),
    "previous_input_messages": Refusal(_empty, "not supported; send the items in input"),
}
_RESPONSES_IGNORED = _PLATFORM | {
    "max_tool_calls",  # counts built-in tool calls, and no built-in tool is served
    "access_programs", "image",  # OpenAI's platform options
}

# endpoint -> (ignored fields, refused fields)
ENDPOINTS: dict[str, tuple[frozenset[str], dict[str, Refusal]]] = {
    "chat": (_CHAT_IGNORED, _CHAT_REFUSED),
    "completion": (_COMPLETION_IGNORED, _COMPLETION_REFUSED),
    "responses": (_RESPONSES_IGNORED, _RESPONSES_REFUSED),
}


def read_fields(obj: dict[str, Any], type_: type, endpoint: str) -> dict[str, Any]:
    """``obj`` (a decoded body) with only the fields ``type_`` declares: ignored fields and
    refused ones at their inert value dropped; 400 naming the first refused or unknown one."""
    declared = {f.encode_name for f in msgspec.structs.fields(type_)}
    ignored, refused = ENDPOINTS[endpoint]
    kept = {}
    for key, value in obj.items():
        if key in declared:
            kept[key] = value
        elif key in refused:
            if not refused[key].inert(value):
                raise ApiError(400, f"{key}: {refused[key].why}", param=key)
        elif key not in ignored:
            shown = key if len(key) <= MAX_KEY_SHOWN else key[:MAX_KEY_SHOWN] + "..."
            raise ApiError(400, f"Unrecognized request argument supplied: {shown}", param=shown)
    return kept


def field_error(e: msgspec.ValidationError) -> InvalidRequest:
    """msgspec's "Expected `int`, got `str` - at `$.messages[0].role`" -> InvalidRequest
    naming ``messages[0].role``."""
    text, path = str(e), ""
    m = _AT.match(text)
    if m:
        text, path = m.group(1), m.group(2).lstrip(".")
    missing = _MISSING.search(text)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return InvalidRequest(path or "body", text)
