"""Admission: how many generating requests the router serves at once, and draining.

    POST /v1/completions, /v1/chat/completions,  counted in flight from the first byte
         /v1/responses                           of the body to the last byte streamed;
                                                 beyond max_inflight: 429 + Retry-After
    draining (SIGTERM)                           every path but /health and /metrics:
                                                 503 + Retry-After; /health says "draining"
    `wait_idle(grace)`                           until no request is in flight, or grace

Overload is refused at once, never queued: a client (or a load balancer) retries
elsewhere or later. Must not route or read bodies.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from aiohttp import web

from ..errors import ApiError
from ..metrics import RouterMetrics

GENERATING_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
OPEN_WHILE_DRAINING = ("/health", "/metrics")  # probes and scrapes see the drain


class Admit(enum.Enum):
    OK = "ok"
    BUSY = "busy"  # max_inflight requests in flight
    DRAINING = "draining"


@dataclass(slots=True)
class Admission:
    max_inflight: int
    retry_after_s: int
    metrics: RouterMetrics
    inflight: int = 0
    draining: bool = False
    _idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while inflight == 0

    def __post_init__(self):
        self._idle.set()

    def enter(self) -> Admit:
        """Count one more generating request in, or say why not."""
        if self.draining:
            return Admit.DRAINING
        if self.inflight >= self.max_inflight:
            return Admit.BUSY
        self.inflight += 1
        self._idle.clear()
        self.metrics.inflight_requests.set(self.inflight)
        return Admit.OK

    def leave(self) -> None:
        assert self.inflight > 0, "leave() without enter()"
        self.inflight -= 1
        self.metrics.inflight_requests.set(self.inflight)
        if self.inflight == 0:
            self._idle.set()

    def start_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight; False if ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    async def guard(self, request: web.Request, handler) -> web.StreamResponse:
        """Run ``handler`` if this request is admitted (app.py's middleware calls this);
        raise the refusal otherwise."""
        if self.draining and request.path not in OPEN_WHILE_DRAINING:
            raise self.refusal(Admit.DRAINING)
        if request.method != "POST" or request.path not in GENERATING_PATHS:
            return await handler(request)
        outcome = self.enter()
        if outcome is not Admit.OK:
            raise self.refusal(outcome)
        try:
            return await handler(request)
        finally:
            self.leave()

    def refusal(self, why: Admit) -> ApiError:
        self.metrics.admission_rejections.labels(reason=why.value).inc()
        headers = {"Retry-After": str(self.retry_after_s)}
        if why is Admit.BUSY:
            return ApiError(429, f"the router is serving its limit of {self.max_inflight} "
                            "requests; retry shortly", code="too_many_requests", headers=headers)
        return ApiError(503, "the router is shutting down; retry on another router",
                        code="draining", headers=headers, close_connection=True)
