"""vLLM's extra endpoints, with vLLM's request and response shapes:

    POST /tokenize     {"prompt": str} or {"messages": [...]}  -> {"count", "max_model_len",
                       "tokens", "token_strs"}   (chat: through the model's chat template)
    POST /detokenize   {"tokens": [int, ...]}                   -> {"prompt": str}
    GET  /version                                               -> {"version": str}
    GET|POST /ping     200 with an empty body while a decode-capable node is known, else 503

Owns only the parsing of these bodies, read and checked as the generation endpoints'
(request_body.py, prepare.py): every bad field is a 400 naming it, a wrong ``model`` a
404. With API keys set, /ping is open like /health (a probe), the rest need a key. Must not reach the nodes or change
any state.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from ... import __version__
from . import endpoints
from ..errors import ApiError
from ..openai.structs import ChatMessage
from ..openai.prepare import chat_messages, check_model, decode_body
from .request_body import off_loop, read_body
from ..tokenizer import RouterTokenizer
from .state import CONFIG, TOKENIZER


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's own (BOS), as for a completion
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # not supported
    add_special_tokens: bool = False  # on top of what the chat template adds
    return_token_strs: bool = False
    chat_template: str | None = None  # not supported
    chat_template_kwargs: dict[str, Any] | None = None  # not supported
    tools: list[Any] | None = None  # not supported


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def register(app: web.Application) -> None:
    """Add this file's routes to the router app."""
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/ping", ping)
    app.router.add_post("/ping", ping)


async def tokenize(request: web.Request) -> web.Response:
    config, tok = request.app[CONFIG], request.app[TOKENIZER]
    body = await read_body(request, config.max_body_bytes, config.body_timeout_s)
    out = await off_loop(body, config.prepare_thread_bytes, _tokenize, tok, config.served_model_names)
    return web.json_response(out)


def _tokenize(body: bytes, tok: RouterTokenizer, served: tuple[str, ...]) -> dict:
    if "messages" in _peek(body):  # vLLM tells the two request kinds apart the same way
        chat: TokenizeChatRequest = decode_body(body, TokenizeChatRequest)
        check_model(chat.model, served)
        for name in ("chat_template", "chat_template_kwargs", "tools"):
            if getattr(chat, name):
                raise ApiError(400, f"{name}: not supported on /tokenize", param=name)
        if chat.continue_final_message:
            raise ApiError(400, "continue_final_message: not supported", param="continue_final_message")
        # a template that rejects the messages raises InvalidRequest: the middleware's 400
        ids = tok.render_chat(chat_messages(chat.messages), chat.add_generation_prompt,
                              chat.add_special_tokens)
        return_strs = chat.return_token_strs
    else:
        plain: TokenizeCompletionRequest = decode_body(body, TokenizeCompletionRequest)
        check_model(plain.model, served)
        ids = tok.encode(plain.prompt, plain.add_special_tokens)
        return_strs = plain.return_token_strs
    return {"count": len(ids), "max_model_len": tok.max_model_len, "tokens": ids,
            "token_strs": tok.token_strs(ids) if return_strs else None}


async def detokenize(request: web.Request) -> web.Response:
    config, tok = request.app[CONFIG], request.app[TOKENIZER]
    body = await read_body(request, config.max_body_bytes, config.body_timeout_s)
    text = await off_loop(body, config.prepare_thread_bytes, _detokenize, tok, config.served_model_names)
    return web.json_response({"prompt": text})


def _detokenize(body: bytes, tok: RouterTokenizer, served: tuple[str, ...]) -> str:
    req: DetokenizeRequest = decode_body(body, DetokenizeRequest)
    check_model(req.model, served)
    for i, t in enumerate(req.tokens):
        if not 0 <= t < tok.vocab_size:
            raise ApiError(400, f"tokens[{i}]: token id {t} is outside the vocabulary "
                           f"[0, {tok.vocab_size})", param=f"tokens[{i}]")
    return tok.decode(req.tokens)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def ping(request: web.Request) -> web.Response:
    """vLLM's liveness probe: /health's status, no body."""
    return web.Response(status=(await endpoints.health(request)).status)


def _peek(body: bytes) -> dict:
    """The body as a dict when it is a JSON object, else {} (decode_body reports the error)."""
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return {}
    return obj if isinstance(obj, dict) else {}
