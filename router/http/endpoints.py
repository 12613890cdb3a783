"""The router's small read-only endpoints: ``GET /v1/models``,
``GET /v1/models/{model}``, ``GET /health``, ``GET /metrics`` and
``GET /debug/decisions`` (the last routing decisions, predicted vs delivered: every
client's traffic, so only to a caller presenting the cluster token, auth.py; open with
request ids hidden on a router with neither API keys nor a cluster token: with an id
anyone could abort another client's request on its node). Must not change any state."""

from __future__ import annotations

import dataclasses

import msgspec
from aiohttp import web

from .auth import has_cluster_token, require_cluster_token
from ..routing.decisions import KEEP
from ..errors import ApiError
from .state import ADMISSION, CONFIG, DECISIONS, METRICS, SERVICES, TOKENIZER

DEFAULT_DECISIONS = 50


def _model_card(request: web.Request, name: str) -> dict:
    """vLLM's model card: ``root`` is the model as loaded, ``max_model_len`` its context
    (the smallest the nodes report, at most the router's own)."""
    config = request.app[CONFIG]
    context = request.app[SERVICES].directory.max_model_len(request.app[TOKENIZER].max_model_len)
    return {"id": name, "object": "model", "created": 0, "owned_by": "splitserve",
            "root": config.model or config.model_id, "parent": None, "max_model_len": context}


async def list_models(request: web.Request) -> web.Response:
    """One card per served name, the primary first."""
    names = request.app[CONFIG].served_model_names
    return web.json_response({"object": "list", "data": [_model_card(request, n) for n in names]})


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if name not in request.app[CONFIG].served_model_names:
        raise ApiError(404, f"The model `{name}` does not exist", param="model",
                       code="model_not_found")
    return web.json_response(_model_card(request, name))


async def health(request: web.Request) -> web.Response:
    """200 while at least one decode-capable node is known and the router is not
    draining, else 503."""
    directory = request.app[SERVICES].directory
    counts = directory.counts()
    decode_capable = counts["decode"] + counts["colocated"]
    draining = request.app[ADMISSION].draining
    status = "draining" if draining else "ok" if decode_capable else "no_decode_node"
    body = {"status": status,
            "prefill_nodes": counts["prefill"], "decode_nodes": counts["decode"],
            "colocated_nodes": counts["colocated"],
            "redis": "ok" if directory.redis_ok else "unreachable"}
    return web.json_response(body, status=200 if status == "ok" else 503)


async def metrics(request: web.Request) -> web.Response:
    text, content_type = request.app[METRICS].render()
    return web.Response(body=text, headers={"Content-Type": content_type})


async def decisions(request: web.Request) -> web.Response:
    """``?limit=N`` (0..KEEP, default 50) most recent routing decisions, oldest first;
    403 without the cluster token (auth.py); ``request_id`` null on an open router."""
    require_cluster_token(request)
    raw = request.query.get("limit", str(DEFAULT_DECISIONS))
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 6 and int(raw) <= KEEP):
        raise ApiError(400, f"limit: must be an integer in [0, {KEEP}], got {raw[:20]!r}",
                       param="limit")
    records = request.app[DECISIONS].last(int(raw))
    if not has_cluster_token(request):
        records = [dataclasses.replace(r, request_id=None) for r in records]
    return web.Response(body=msgspec.json.encode({"decisions": records}),
                        content_type="application/json")
