"""The typed app keys of the router's aiohttp app and the services its lifespan
owns. Must not create anything (app.py builds and tears down)."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from aiohttp import web

from splitserve.common.kv_index import KVIndex
from splitserve.common.registry import NodeRegistry
from splitserve.router.admission import Admission
from splitserve.router.background import BackgroundTasks
from splitserve.router.config import RouterConfig
from splitserve.router.decisions import DecisionLog
from splitserve.router.discovery import NodeDirectory
from splitserve.router.dispatch import Dispatcher
from splitserve.router.metrics import RouterMetrics
from splitserve.router.tokenizer import RouterTokenizer


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


CONFIG = web.AppKey("config", RouterConfig)
TOKENIZER = web.AppKey("tokenizer", RouterTokenizer)
METRICS = web.AppKey("metrics", RouterMetrics)
DECISIONS = web.AppKey("decisions", DecisionLog)
SERVICES = web.AppKey("services", RouterServices)
ADMISSION = web.AppKey("admission", Admission)
REQUEST_ID = web.RequestKey("request_id", str)  # the x-request-id of this request
