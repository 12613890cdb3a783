"""The per-key compile budget: how many structured-output constraints the router has not
seen before one API key may send at once, and per minute.

A new constraint costs a node a grammar compile (up to its --grammar-compile-timeout of a
worker's CPU, node/grammar_service.py); one a node already answered costs nothing more
(the node keeps it compiled, or refuses it again from memory). So, per API key (a digest
of it, router/http/auth.py ``key_owner``; a router without keys has one bucket for all):

    constraint the router saw a node answer (its digest    admitted, not counted
      among the last MAX_CACHED_GRAMMARS)
    one a request in flight is compiling                   admitted, not counted (a node
                                                           compiles it once for both)
    new, the key below both limits                         admitted, counted until the node
                                                           answered (accepted or refused)
    new, ``concurrent`` of the key's new ones in flight    429, Retry-After: RETRY_AFTER_S
    new, ``per_minute`` of the key's in the last minute    429, Retry-After: until the oldest
                                                           of them is a minute old

So one key never holds more than ``concurrent`` of a node's compile workers, and spends at
most ``per_minute`` compiles of the fleet's CPU a minute, whatever other keys do. Must not
read bodies or know nodes.
"""

from __future__ import annotations

import enum
import hashlib
import math
import time
from collections import OrderedDict, deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from ...common.grammar_limits import MAX_CACHED_GRAMMARS
from ...common.sampling_params import SamplingParams
from ..errors import ApiError

WINDOW_S = 60.0
RETRY_AFTER_S = 1  # a key at its concurrency limit: one of its compiles ends within seconds
REJECTION_REASON = "schema_compiles"  # the admission-rejections metric's label (metric_names)


class CompileAdmit(enum.Enum):
    KNOWN = "known"  # a node answered this constraint before: not counted
    SHARED = "shared"  # another request in flight brings it: not counted
    NEW = "new"
    CONCURRENT = "concurrent"  # the key has `concurrent` new constraints in flight: 429
    RATE = "rate"  # the key sent `per_minute` new constraints in the last minute: 429


@dataclass(slots=True)
class _Key:
    inflight: int = 0  # new constraints of this key whose node has not answered yet
    recent: deque[float] = field(default_factory=deque)  # when each new one of the last minute came


class CompileBudget:
    def __init__(self, concurrent: int, per_minute: int, on_reject: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``on_reject``: counts a 429 (the router's admission-rejections metric)."""
        self.concurrent, self.per_minute = concurrent, per_minute
        self._on_reject = on_reject
        self._clock = clock
        self._known: OrderedDict[bytes, None] = OrderedDict()  # digests nodes answered, LRU
        self._inflight: dict[bytes, int] = {}  # digest -> its requests in flight, new or shared
        self._keys: dict[str | None, _Key] = {}

    @asynccontextmanager
    async def compile_slot(self, owner: str | None, params: SamplingParams) -> AsyncIterator[CompileAdmit]:
        """Around starting a request on its nodes (the node compiles before it answers):
        raises a 429 `ApiError` when ``owner``'s budget is spent; the constraint becomes
        known when the body returns or raises a 4xx (a node refused it)."""
        so = params.structured_outputs
        if so is None:
            yield CompileAdmit.KNOWN
            return
        spec = so.spec()
        digest = hashlib.sha256(f"{spec.kind.value}\0{int(spec.any_whitespace)}\0{spec.source}".encode()).digest()
        if digest in self._known:
            self._known.move_to_end(digest)
            yield CompileAdmit.KNOWN
            return
        key = self._keys.setdefault(owner, _Key())
        outcome = CompileAdmit.SHARED if digest in self._inflight else self._admit(key)
        if outcome not in (CompileAdmit.NEW, CompileAdmit.SHARED):
            raise self._refusal(key, outcome)
        if outcome is CompileAdmit.NEW:
            key.inflight += 1
            key.recent.append(self._clock())
        self._inflight[digest] = self._inflight.get(digest, 0) + 1
        answered = False
        try:
            yield outcome
            answered = True
        except ApiError as e:
            answered = 400 <= e.status < 500
            raise
        finally:
            if outcome is CompileAdmit.NEW:
                key.inflight -= 1
            self._inflight[digest] -= 1
            if not self._inflight[digest]:
                del self._inflight[digest]
            if answered:
                self._known[digest] = None
                while len(self._known) > MAX_CACHED_GRAMMARS:
                    self._known.popitem(last=False)
            if key.inflight == 0 and not key.recent:
                self._keys.pop(owner, None)

    def _admit(self, key: _Key) -> CompileAdmit:
        now = self._clock()
        while key.recent and now - key.recent[0] >= WINDOW_S:
            key.recent.popleft()
        if key.inflight >= self.concurrent:
            return CompileAdmit.CONCURRENT
        if len(key.recent) >= self.per_minute:
            return CompileAdmit.RATE
        return CompileAdmit.NEW

    def _refusal(self, key: _Key, outcome: CompileAdmit) -> ApiError:
        if self._on_reject is not None:
            self._on_reject()
        if outcome is CompileAdmit.CONCURRENT:
            return ApiError(429, f"this API key already has {key.inflight} new structured-output constraints "
                            f"compiling (at most {self.concurrent} at once); retry when they are done",
                            code="too_many_requests", headers={"Retry-After": str(RETRY_AFTER_S)})
        wait = max(1, math.ceil(WINDOW_S - (self._clock() - key.recent[0])))
        return ApiError(429, f"this API key sent {len(key.recent)} new structured-output constraints in the "
                        f"last minute, at most {self.per_minute}; constraints it sent before cost nothing; "
                        f"retry in {wait} s", code="too_many_requests", headers={"Retry-After": str(wait)})
