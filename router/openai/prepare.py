"""Request parsing: an OpenAI JSON body -> prompt token ids + `SamplingParams`.

Owns every check of user input on the router: JSON shape and types, unsupported
parameters, the model name, chat messages, prompt forms, sampling ranges (through
`SamplingParams.validate`) and the context length. Every bad input raises `ApiError`
(400 naming the field, 404 for an unknown model); nothing here raises anything else
on user input.

Must not do I/O or know about nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from ...common.chat import CHAT_ROLES
from ...common.errors import InvalidRequest
from ...common.sampling_params import SEED_MAX, SamplingParams
from ..api_keys import effective_cache_salt
from ..errors import ApiError
from .json_shape import MAX_JSON_DEPTH, check_shape
from .structs import ChatCompletionRequest, ChatMessage, CompletionRequest
from ..prompt import Prompt
from .request_fields import field_error, read_fields
from .structured import Constraint, request_constraint
from ..tokenizer import RouterTokenizer
from .tool_calls import ToolPlan, inline_tools, plan_tools

MAX_PROMPTS = 128  # prompts in one batched /v1/completions request
MAX_N = 16  # choices per prompt (n)
MAX_CHOICES = 128  # prompts * n in one request: each is a generation on a decode node

# SamplingParams field -> the OpenAI parameter the user wrote, per endpoint
_CHAT_FIELD_NAMES = {"logprobs": "top_logprobs"}


@dataclass(slots=True)
class PreparedRequest:
    """A validated request, ready to route."""

    kind: Literal["completion", "chat"]
    model: str
    prompts: list[Prompt]  # one per choice, in index order (prompt i: choices i*n .. i*n+n-1)
    params: SamplingParams  # validated; shared by every prompt (`choice_params` gives choice j's)
    stream: bool
    include_usage: bool  # streaming: send a last chunk with usage
    logprobs: bool  # return logprobs (params.logprobs alternatives each)
    constraint_field: str | None = None  # the parameter params.structured_outputs came from
    tools: ToolPlan | None = None  # chat with tools: how to render and parse them
    n: int = 1  # choices per prompt
    echo: list[str] | None = None  # completions with echo: each choice's prompt text
    score_only: bool = False  # max_tokens 0: the one token generated is dropped
    prompt_logprobs: bool = False  # return vLLM's prompt_logprobs (the user asked for them)
    # the request's own cache_salt; its prompts are hashed with this combined with the API
    # key's salt (`salted_prompts`, router/api_keys.py)
    cache_salt: str | None = None

    def salted_prompts(self, key_salt: str | None) -> list[Prompt]:
        """``prompts`` hashed under the effective salt of ``key_salt`` (the API key's) and
        the request's own ``cache_salt``."""
        salt = effective_cache_salt(key_salt, self.cache_salt)
        return [p.salted(salt) for p in self.prompts]

    def choice_params(self, index: int) -> SamplingParams:
        """Choice ``index``'s parameters: with a seed, the j-th sample of a prompt uses
        seed + j (as vLLM's parallel sampling does), so the n samples differ."""
        j = index % self.n
        if self.params.seed is None or j == 0:
            return self.params
        seed = self.params.seed + j
        if seed > SEED_MAX:
            seed -= 2**64  # stays in the accepted range
        return msgspec.structs.replace(self.params, seed=seed)


def decode_body(body: bytes, type_: type, endpoint: str | None = None) -> Any:
    """JSON body -> ``type_`` instance; 400 naming the field on any problem. With an
    ``endpoint`` (a request_fields.ENDPOINTS key), its unknown-field rule applies first."""
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from e
    except RecursionError:  # msgspec's own guard, far beyond MAX_JSON_DEPTH
        raise ApiError(400, f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels",
                       param="body") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(obj).__name__}")
    try:
        check_shape(obj)
    except InvalidRequest as e:
        raise ApiError.invalid(e) from e
    if endpoint is not None:
        obj = read_fields(obj, type_, endpoint)
    try:
        return msgspec.convert(obj, type_)
    except msgspec.ValidationError as e:
        raise ApiError.invalid(field_error(e)) from e


def prepare_completion(body: bytes, tok: RouterTokenizer, served: tuple[str, ...],
                       max_model_len: int | None = None) -> PreparedRequest:
    """``served``: the names clients may request (RouterConfig.served_model_names);
    ``max_model_len``: the context the nodes accept (None: the tokenizer's)."""
    max_model_len = max_model_len or tok.max_model_len
    req: CompletionRequest = decode_body(body, CompletionRequest, "completion")
    model_id = _check_common(req, served)
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(400, f"best_of: only best_of equal to n (or null) is supported, got "
                       f"{_brief(req.best_of)} with n={req.n}", param="best_of")
    if req.suffix is not None:
        raise ApiError(400, "suffix: not supported", param="suffix")
    prompts = _completion_prompts(req.prompt, tok, req.add_special_tokens)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    # max_tokens 0 scores the prompt (echo or prompt_logprobs): one token is generated, as
    # vLLM does, and dropped
    score_only = max_tokens == 0 and (req.echo or req.prompt_logprobs is not None)
    # echo with logprobs returns the prompt's logprobs too: the prefill computes them
    prompt_lps = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_lps = req.logprobs if prompt_lps is None else max(req.logprobs, prompt_lps)
    constraint = request_constraint(req)
    params = _sampling_params(req, max_tokens=1 if score_only else max_tokens, logprobs=req.logprobs,
                              renames={}, prompt_logprobs=prompt_lps, vocab_size=tok.vocab_size,
                              constraint=constraint)
    _check_context(prompts, params, max_model_len, "prompt", "max_tokens")
    echo = [t for t in _prompt_texts(req.prompt, prompts, tok) for _ in range(req.n)] if req.echo else None
    return PreparedRequest("completion", model_id, _per_choice(prompts, req.n), params, req.stream,
                           _include_usage(req), req.logprobs is not None,
                           constraint.field if constraint else None, n=req.n, echo=echo,
                           score_only=score_only, prompt_logprobs=req.prompt_logprobs is not None,
                           cache_salt=req.cache_salt)


def prepare_chat(body: bytes, tok: RouterTokenizer, served: tuple[str, ...],
                 max_model_len: int | None = None) -> PreparedRequest:
    req: ChatCompletionRequest = decode_body(body, ChatCompletionRequest, "chat")
    return prepare_chat_request(req, tok, served, max_model_len)


def prepare_chat_request(req: ChatCompletionRequest, tok: RouterTokenizer, served: tuple[str, ...],
                         max_model_len: int | None = None) -> PreparedRequest:
    """Every check and the rendering of a decoded chat request (/v1/chat/completions, and
    /v1/responses through the chat request it maps to)."""
    max_model_len = max_model_len or tok.max_model_len
    model_id = _check_common(req, served)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
    tools = plan_tools(req)
    constraint = request_constraint(req)
    if tools is not None and tools.constraint is not None:
        if constraint is not None:
            raise ApiError(400, f"{constraint.field}: cannot be combined with tool_choice "
                           f"{tools.mode.value}", param=constraint.field)
        assert tools.field is not None  # a plan with a constraint names its parameter
        constraint = Constraint(tools.constraint, tools.field)
    prompt = _chat_prompt(req, tok, tools)
    budget_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:  # OpenAI: as many as the context leaves
        max_tokens = max(1, max_model_len - len(prompt))
    renames = dict(_CHAT_FIELD_NAMES, max_tokens=budget_name)
    params = _sampling_params(req, max_tokens=max_tokens,
                              logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                              renames=renames, prompt_logprobs=req.prompt_logprobs,
                              vocab_size=tok.vocab_size, constraint=constraint)
    _check_context([prompt], params, max_model_len, "messages", budget_name)
    return PreparedRequest("chat", model_id, _per_choice([prompt], req.n), params, req.stream,
                           _include_usage(req), req.logprobs,
                           constraint.field if constraint else None, tools, n=req.n,
                           prompt_logprobs=req.prompt_logprobs is not None, cache_salt=req.cache_salt)


def _prompt_texts(prompt: str | list, prompts: list[Prompt], tok: RouterTokenizer) -> list[str]:
    """Each prompt's text as echoed: as sent, or decoded when sent as token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [tok.decode(p.ids) for p in prompts]


def _per_choice(prompts: list[Prompt], n: int) -> list[Prompt]:
    """Prompt i once for each of its n choices (indices i*n .. i*n+n-1)."""
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"n: {len(prompts)} prompts x n={n} is {len(prompts) * n} choices; at most "
                       f"{MAX_CHOICES} per request", param="n")
    return [p for p in prompts for _ in range(n)]


def _brief(value) -> str:
    return str(value) if abs(value) < 10**12 else "a huge integer"


def check_model(model: str | None, served: tuple[str, ...]) -> str:
    """The model name to answer with: the one requested, as vLLM does, or the first
    served name when none was given; 404 for a name this router does not serve."""
    if model is not None and model not in served:
        raise ApiError(404, f"The model `{model}` does not exist; this router serves "
                       + ", ".join(f"`{n}`" for n in served), param="model", code="model_not_found")
    return served[0] if model is None else model


def _check_common(req, served: tuple[str, ...]) -> str:
    """Checks shared by both endpoints; returns the model name to answer with."""
    model = check_model(req.model, served)
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n: must be in [1, {MAX_N}], got {_brief(req.n)}", param="n")
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError(400, "prompt_logprobs: not available with stream=true", param="prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed with stream=true", param="stream_options")
    if req.cache_salt is not None and not req.cache_salt:
        raise ApiError(400, "cache_salt: must be a non-empty string (or left out)", param="cache_salt")
    return model


def _include_usage(req) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _sampling_params(req, max_tokens: int, logprobs: int | None, renames: dict[str, str],
                     prompt_logprobs: int | None, vocab_size: int,
                     constraint: Constraint | None = None) -> SamplingParams:
    given = {name: getattr(req, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "stop_token_ids", "min_tokens")}
    kwargs = {k: v for k, v in given.items() if v is not None}
    if req.stop is not None:
        kwargs["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.logit_bias:
        kwargs["logit_bias"] = _logit_bias(req.logit_bias)
    if constraint is not None:
        kwargs["structured_outputs"] = constraint.params
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, ignore_eos=req.ignore_eos,
                                prompt_logprobs=prompt_logprobs,
                                include_stop_str_in_output=req.include_stop_str_in_output,
                                **kwargs).validate()
        params.check_vocab(vocab_size)
        return params
    except InvalidRequest as e:
        field = renames.get(e.field, e.field)
        raise ApiError(400, f"{field}: {e.message}", param=field) from e


def _logit_bias(bias: dict) -> dict:
    """OpenAI's {"token id as a string": bias} -> {token id: bias}; ranges are checked by
    `SamplingParams.validate`."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise ApiError(400, f"logit_bias: keys must be token ids written as strings (\"50256\"), "
                           f"got {key[:40]!r}", param="logit_bias")
        out[int(key)] = value
    return out


def _completion_prompts(prompt: str | list, tok: RouterTokenizer,
                        add_special_tokens: bool = True) -> list[Prompt]:
    """The four prompt forms -> one validated `Prompt` per prompt."""
    if isinstance(prompt, str):
        texts_or_ids: list = [prompt]
    elif not prompt:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    elif all(isinstance(p, str) for p in prompt):
        texts_or_ids = prompt
    elif _token_ids(prompt):
        texts_or_ids = [prompt]
    elif all(isinstance(p, list) and _token_ids(p) for p in prompt):
        texts_or_ids = prompt
    else:
        raise ApiError(400, "prompt: must be a string, a list of strings, a list of token ids "
                       "or a list of token-id lists", param="prompt")
    if len(texts_or_ids) > MAX_PROMPTS:
        raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got "
                       f"{len(texts_or_ids)}", param="prompt")
    prompts = []
    for p in texts_or_ids:
        ids = tok.encode(p, add_special_tokens) if isinstance(p, str) else p
        if not ids:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        try:
            prompts.append(Prompt.of(ids, tok.vocab_size))
        except InvalidRequest as e:
            raise ApiError.invalid(e) from e
    return prompts


def _token_ids(items: list) -> bool:
    """Every item is an int (not a bool, not a float); one C pass over the types."""
    return set(map(type, items)) <= {int}


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Checked messages -> the ``{"role", "content"}`` dicts the chat template renders
    (with ``tool_calls`` / ``tool_call_id`` where given, as transformers takes them)."""
    if not messages:
        raise ApiError(400, "messages: must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, "
                           f"got {m.role!r}", param=f"messages[{i}].role")
        msg: dict[str, Any] = {"role": m.role, "content": _message_text(m.content, m.role, i, bool(m.tool_calls))}
        if m.tool_calls:
            msg["tool_calls"] = [{"type": "function", "id": c.id, "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _chat_prompt(req: ChatCompletionRequest, tok: RouterTokenizer, tools: ToolPlan | None) -> Prompt:
    messages = chat_messages(req.messages)
    rendered = tools.tools if tools is not None else []
    if not tok.renders_tools:
        messages, rendered = inline_tools(messages, rendered), []
    try:
        ids = tok.render_chat(messages, tools=rendered or None,
                              template_kwargs=req.chat_template_kwargs)
    except InvalidRequest as e:
        raise ApiError.invalid(e) from e
    if not ids:
        raise ApiError(400, "messages: the rendered conversation is empty", param="messages")
    try:
        return Prompt.of(ids, tok.vocab_size, "messages")
    except InvalidRequest as e:  # a template emitting ids past the vocabulary
        raise ApiError.invalid(e) from e


def _message_text(content, role: str, i: int, has_tool_calls: bool = False) -> str:
    param = f"messages[{i}].content"
    if content is None:
        if role != "assistant" and not has_tool_calls:
            raise ApiError(400, f"{param}: must be a string or a list of text parts", param=param)
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"{param}[{j}]: only text parts ({{\"type\": \"text\", \"text\": "
                           f"...}}) are supported, got type {part.type!r}", param=f"{param}[{j}]")
        parts.append(part.text)
    return "".join(parts)


def _check_context(prompts: list[Prompt], params: SamplingParams, max_model_len: int,
                   prompt_name: str, budget_name: str) -> None:
    for ids in prompts:
        if len(ids) >= max_model_len:
            raise ApiError(400, f"{prompt_name}: {len(ids)} tokens, the model's context is "
                           f"{max_model_len} tokens; shorten the prompt", param=prompt_name)
        if len(ids) + params.max_tokens > max_model_len:
            raise ApiError(400, f"{budget_name}: the prompt has {len(ids)} tokens, so "
                           f"{budget_name}={params.max_tokens} exceeds the model's context of "
                           f"{max_model_len} tokens; set {budget_name} <= "
                           f"{max_model_len - len(ids)}", param=budget_name)
