"""The Responses API's endpoints:

    POST   /v1/responses        create, whole (JSON) or streamed (typed SSE events)
    GET    /v1/responses/{id}   a stored response (404 when unknown, deleted or expired)
    DELETE /v1/responses/{id}   forget it

A create runs on the chat path end to end::

    read body (request_body.py) -> decode (request_fields.py, responses/request.py)
      -> previous_response_id: its stored conversation (responses/store.py; 400 if unknown)
      -> unless "store": false, room for it in the key's quota (429 / 503 before any work)
      -> prepare (responses/prepare.py -> prepare.py; on a worker thread when the whole
         conversation, stored history and new body, is large)
      -> start the generation (completions.py start_all -> streams/dispatch.py)
      -> the chat bodies (bodies.py) -> the response (responses/objects.py) or its
         events (responses/events.py)
      -> store it (unless "store": false), then answer / send response.completed; a store
         the quota refuses now is a 429 / 503 (streamed: error, response.failed)
      -> always: close the generation (aborts it on its node unless it finished)

Must not validate fields (the prepare modules do) or talk to nodes (dispatch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from aiohttp import web

from .auth import key_owner, key_salt
from ..openai.bodies import BodyBuilder, usage
from ..errors import ApiError
from ..streams.generation import Generation, merge_pieces
from .completions import client_gone_away, start_all
from .request_body import off_loop, read_body
from ..responses.events import EventStream
from ..responses.objects import ResponseHead, new_id, output_of, usage_of
from ..responses.prepare import ResponsesPrepared, decode_responses, prepare_responses
from ..responses.request import parse_items
from ..responses.store import refusal
from .state import COMPILE_BUDGET, CONFIG, METRICS, SERVICES, TOKENIZER
from ..openai.structured import renamed_constraint_error

log = logging.getLogger(__name__)


def register(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)


async def create(request: web.Request) -> web.StreamResponse:
    t_start = asyncio.get_running_loop().time()
    app = request.app
    config, tok, services = app[CONFIG], app[TOKENIZER], app[SERVICES]
    body = await read_body(request, config.max_body_bytes, config.body_timeout_s)
    req = await off_loop(body, config.prepare_thread_bytes, decode_responses)
    owner = key_owner(request)
    history: list[dict[str, Any]] = []
    size = len(body)  # the conversation's, in bytes: what preparing and storing it costs
    if req.previous_response_id is not None:
        stored = await services.responses.get(req.previous_response_id, owner)
        if stored is None:
            raise ApiError(400, f"previous_response_id: no stored response {req.previous_response_id!r}"
                           " (unknown, deleted, expired, or created with store=false)",
                           param="previous_response_id")
        history, size = stored.history, size + stored.nbytes
    if req.store is not False:
        verdict = await services.responses.admit(owner, size)
        if (err := refusal(verdict)) is not None:  # refused before any work
            app[METRICS].responses_stored.labels(verdict.result).inc()
            raise err
    max_model_len = services.directory.max_model_len(tok.max_model_len)
    rp: ResponsesPrepared = await off_loop(
        body, config.prepare_thread_bytes,
        lambda _: prepare_responses(req, history, tok, config.served_model_names, max_model_len), size=size)
    head = ResponseHead(new_id("resp"), int(time.time()), rp.prep.model, req)
    builder = BodyBuilder(rp.prep, tok, head.id, head.created_at)
    salt = key_salt(request)
    try:
        gens = await app[COMPILE_BUDGET].start(  # 429: the key's budget
            owner, rp.prep.params,
            lambda grant: start_all(services.dispatcher, rp.prep, head.id, t_start, salt, grant))
    except ApiError as e:  # a node could not compile the grammar: name the user's parameter
        raise renamed_constraint_error(e, rp.prep.constraint_field) from None
    client_gone = False
    try:
        if rp.prep.stream:
            return await _stream(request, rp, head, builder, gens, size)
        async with contextlib.aclosing(merge_pieces(gens)) as pieces:
            async for piece in pieces:
                builder.add(piece)
                if client_gone_away(request):
                    client_gone = True
                    return web.Response(status=499)  # never sent: nobody is listening
        output, status = output_of(builder.final(gens))
        response = head.body(status, output, usage_of(usage(gens)))
        if (err := await _store(request, rp, response, size)) is not None:
            raise err  # the key crossed its quota with this response: it is not kept
        return web.json_response(response)
    except (asyncio.CancelledError, ConnectionResetError):  # the client went away
        client_gone = True
        raise
    finally:
        for g in gens:
            g.close(client_gone=client_gone)


async def _stream(request: web.Request, rp: ResponsesPrepared, head: ResponseHead,
                  builder: BodyBuilder, gens: list[Generation], size: int) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    events = EventStream(head, rp.logprobs)

    async def send(batch: list[dict[str, Any]]) -> None:
        await resp.write(b"".join(
            f"event: {e['type']}\ndata: ".encode() + json.dumps(e, ensure_ascii=False).encode()
            + b"\n\n" for e in batch))

    await resp.prepare(request)
    await send(events.start())
    try:
        async with contextlib.aclosing(merge_pieces(gens)) as pieces:
            async for piece in pieces:
                await send(events.chunk(builder.chunk(piece)))
    except ApiError as e:  # a node failed mid-stream: the 200 is already sent
        log.warning("response %s: %s", head.id, e.message)
        await send(events.fail(e))
    except ConnectionResetError:
        raise
    except Exception:
        log.exception("response %s: unexpected error while streaming", head.id)
        await send(events.fail(ApiError(500, "internal error while streaming; see the router's log")))
    else:
        last, response = events.finish(usage_of(usage(gens)))
        refused = await _store(request, rp, response, size)  # before the client hears
        await send(last if refused is None else events.fail(refused))
    await resp.write_eof()
    return resp


async def _store(request: web.Request, rp: ResponsesPrepared, response: dict[str, Any],
                 size: int) -> ApiError | None:
    """Keep the response and its conversation (the input, then the output as input items)
    for a later previous_response_id of the same key, unless the request said store=false.
    The error answer when the key's quota or a full store refuses it (else None: stored,
    or skipped with a log line). ``size``: the conversation's bytes before the output (a
    large one is serialized on a worker thread)."""
    if rp.request.store is False:
        return None
    history = rp.items + parse_items(response["output"], "output", set())
    verdict = await request.app[SERVICES].responses.put(response, history, key_owner(request),
                                                        large=size > request.app[CONFIG].prepare_thread_bytes)
    request.app[METRICS].responses_stored.labels(verdict.result).inc()
    return refusal(verdict)


async def retrieve(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    stored = await request.app[SERVICES].responses.get(response_id, key_owner(request))
    if stored is None:
        raise _not_found(response_id)
    return web.json_response(stored.response)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not await request.app[SERVICES].responses.delete(response_id, key_owner(request)):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id {response_id[:128]!r} not found (unknown, deleted, "
                    "expired, or created with store=false)", param="response_id")
