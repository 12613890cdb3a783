"""The typed app keys of the router's aiohttp app and the services its lifespan
owns. Must not create anything (app.py builds and tears down)."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from aiohttp import web

from ...common.kv_index import KVIndex
from ...common.node_registry import NodeRegistry
from .admission import Admission
from ..streams.background import BackgroundTasks
from .compile_budget import CompileBudget
from ..config import RouterConfig
from ..routing.decisions import DecisionLog
from ..routing.discovery import NodeDirectory
from ..streams.dispatch import Dispatcher
from ..metrics import RouterMetrics
from ..routing.policy import RoutingPolicy
from ..responses.store import ResponseStore
from ..tokenizer import RouterTokenizer


@dataclass(slots=True)
class RouterServices:
    """What the app's lifespan creates (Redis clients, HTTP client, background tasks)
    and closes, in reverse order."""

    registry: NodeRegistry
    index: KVIndex
    directory: NodeDirectory
    session: aiohttp.ClientSession
    background: BackgroundTasks
    dispatcher: Dispatcher
    responses: ResponseStore  # stored /v1/responses (previous_response_id, GET, DELETE)


CONFIG = web.AppKey("config", RouterConfig)
TOKENIZER = web.AppKey("tokenizer", RouterTokenizer)
METRICS = web.AppKey("metrics", RouterMetrics)
DECISIONS = web.AppKey("decisions", DecisionLog)
POLICY = web.AppKey[RoutingPolicy]("policy")  # built once with the app; its state lives as long
SERVICES = web.AppKey("services", RouterServices)
ADMISSION = web.AppKey("admission", Admission)
COMPILE_BUDGET = web.AppKey("compile_budget", CompileBudget)  # per API key: new structured-output constraints
REQUEST_ID = web.RequestKey("request_id", str)  # the x-request-id of this request
