"""The generating endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions``,
streamed (SSE) or whole.

Owns one request's life on the router::

    read body (415/413/408: request_body.py) -> prepare (400/404; a body over
      prepare_thread_bytes on a worker thread, so a long prompt never stalls the loop)
      -> start every prompt on a decode node (503/4xx/502) under the key's compile
         budget for a structured-output constraint (429: compile_budget.py)
      -> stream: 200 text/event-stream, "data: {chunk}\\n\\n"..., "data: [DONE]\\n\\n"
      -> whole:  200 JSON once every choice finished
      -> always: close every generation (aborts it on its node unless it finished)

A client that goes away mid-stream (write fails, or the handler is cancelled)
aborts its requests on the decode nodes; a node failing mid-stream ends the stream
with an error event (before streaming started: a 502 JSON error).

Must not validate fields itself (prepare.py) or talk to nodes directly (dispatch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import NamedTuple

from aiohttp import web

from .auth import key_owner, key_salt
from ..streams.dispatch import Dispatcher
from ..errors import ApiError, sse_error
from ..streams.generation import Generation, merge_pieces
from ..openai.prepare import PreparedRequest, prepare_chat, prepare_completion
from .request_body import off_loop, read_body
from ..openai.bodies import BodyBuilder
from ..openai.structured import renamed_constraint_error
from .compile_budget import NO_CONSTRAINT, CompileAdmit, CompileGrant
from .state import COMPILE_BUDGET, CONFIG, SERVICES, TOKENIZER

log = logging.getLogger(__name__)

_DONE = b"data: [DONE]\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, prepare_completion, "cmpl-")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, prepare_chat, "chatcmpl-")


async def _generate(request: web.Request, prepare, id_prefix: str) -> web.StreamResponse:
    t_start = asyncio.get_running_loop().time()
    app = request.app
    config = app[CONFIG]
    body = await read_body(request, config.max_body_bytes, config.body_timeout_s)
    tok = app[TOKENIZER]
    max_model_len = app[SERVICES].directory.max_model_len(tok.max_model_len)
    prep: PreparedRequest = await off_loop(body, config.prepare_thread_bytes, prepare, tok,
                                           config.served_model_names, max_model_len)
    response_id = id_prefix + uuid.uuid4().hex
    builder = BodyBuilder(prep, app[TOKENIZER], response_id, int(time.time()))
    salt = key_salt(request)
    try:
        gens = await app[COMPILE_BUDGET].start(  # 429: the key's budget
            key_owner(request), prep.params,
            lambda grant: start_all(app[SERVICES].dispatcher, prep, response_id, t_start, salt, grant))
    except ApiError as e:  # a node could not compile the grammar: name the user's parameter
        raise renamed_constraint_error(e, prep.constraint_field) from None
    client_gone = False
    try:
        if prep.stream:
            outcome = await _stream(request, prep, builder, gens)
            client_gone = outcome.client_gone
            return outcome.response
        async with contextlib.aclosing(merge_pieces(gens)) as pieces:
            async for piece in pieces:
                builder.add(piece)
                if client_gone_away(request):  # without handler_cancellation, notice it here
                    client_gone = True
                    return web.Response(status=499)  # never sent: nobody is listening
        return web.json_response(builder.final(gens))
    except asyncio.CancelledError:  # the client went away (handler_cancellation=True)
        client_gone = True
        raise
    finally:
        for g in gens:
            g.close(client_gone=client_gone)


async def start_all(dispatcher: Dispatcher, prep: PreparedRequest, response_id: str,
                    t_start: float, key_salt: str | None = None,
                    grant: CompileGrant = NO_CONSTRAINT) -> list[Generation]:
    """Start every choice of the request; all started or none (the started ones are
    closed, which aborts them, before the first error is raised). ``key_salt``: the
    cache salt of the caller's API key; with the request's own ``cache_salt`` it makes
    the salt every prompt is hashed under (router/api_keys.py). ``grant``: its
    structured-output constraint's admission (compile_budget.py).

    With n > 1, the first choice of each prompt is routed and started first; the other
    n - 1 are then pinned to its nodes, so the prompt's prefix is one prefill node's.
    A NEW constraint's request starts its first choice first and pins every other one
    to its nodes: one decode node and one prefill node compile it."""
    prompts = prep.salted_prompts(key_salt)
    ticket = None if grant.admit is CompileAdmit.NONE else grant.ticket

    def start(i: int, pin=None):
        return dispatcher.start(i, f"{response_id}-{i}", prompts[i], prep.choice_params(i),
                                t_start, pin=pin, score_only=prep.score_only,
                                compile_grammar=grant.compile, ticket=ticket)

    if len(prep.prompts) == 1:
        return [await start(0)]
    if grant.admit is CompileAdmit.NEW:
        first = await start(0)
        try:
            rest = await _start_group([start(i, pin=first.leg.decision) for i in range(1, len(prep.prompts))])
        except BaseException:
            first.close(client_gone=True)
            raise
        return [first, *rest]
    leaders = await _start_group([start(i) for i in range(0, len(prep.prompts), prep.n)])
    if prep.n == 1:
        return leaders
    try:
        followers = await _start_group([start(i, pin=leader.leg.decision) for leader in leaders
                                        for i in range(leader.index + 1, leader.index + prep.n)])
    except BaseException:
        for g in leaders:
            g.close(client_gone=True)
        raise
    by_index = {g.index: g for g in (*leaders, *followers)}
    return [by_index[i] for i in range(len(prep.prompts))]


async def _start_group(coros: list) -> list[Generation]:
    """Run the starts concurrently; all started or none."""
    if len(coros) == 1:
        return [await coros[0]]
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(c) for c in coros]
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
            t.add_done_callback(_close_started)
        raise
    errors = [e for t in tasks if (e := t.exception()) is not None]
    if errors:
        for t in tasks:
            _close_started(t)
        raise errors[0]
    return [t.result() for t in tasks]


def client_gone_away(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _close_started(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close(client_gone=True)


class StreamOutcome(NamedTuple):
    response: web.StreamResponse
    client_gone: bool  # a write failed: the client closed the connection


async def _stream(request: web.Request, prep: PreparedRequest, builder: BodyBuilder,
                  gens: list[Generation]) -> StreamOutcome:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})

    async def send(obj: dict) -> None:
        await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    try:
        await resp.prepare(request)
        if prep.kind == "chat":
            for g in gens:
                await send(builder.role_chunk(g.index))
        try:
            async with contextlib.aclosing(merge_pieces(gens)) as pieces:
                async for piece in pieces:
                    await send(builder.chunk(piece))
        except ApiError as e:  # a node failed mid-stream: the 200 is already sent
            log.warning("request %s: %s", builder.id, e.message)
            await resp.write(sse_error(e))
        except ConnectionResetError:
            raise
        except Exception:
            log.exception("request %s: unexpected error while streaming", builder.id)
            await resp.write(sse_error(ApiError(500, "internal error while streaming; see the "
                                                "router's log")))
        else:
            if prep.include_usage:
                await send(builder.usage_chunk(gens))
        await resp.write(_DONE)
        await resp.write_eof()
    except ConnectionResetError:  # aiohttp: "Cannot write to closing transport"
        return StreamOutcome(resp, client_gone=True)
    return StreamOutcome(resp, client_gone=False)
