"""The per-key compile budget: each structured-output grammar a node compiles for an API key
is one of the key's compiles, at most ``concurrent`` at once and ``per_minute`` a minute.

Every node compiles a constraint apart, the first time it needs it and again once its cache
evicted it (by count and by bytes, node/grammar_service.py). The router cannot see those
caches, so it never assumes one: each request with a constraint tells its nodes whether
they may compile (`GenerateRequest.compile_grammar`, forwarded to the prefill node), and a
node told not to answers 409 GRAMMAR_NOT_COMPILED instead of compiling. Per API key (a
digest of it, router/http/auth.py ``key_owner``; a router without keys has one bucket):

    a constraint a node answered before (its digest among      KNOWN: compile_grammar false,
      the last MAX_CACHED_GRAMMARS), or one a request in          not counted: free where a
      flight brings (SHARED)                                      node holds it (or compiles it)
        its decode node does not hold it (the 409)             -> started again as new, below
                                                                  (still known: others may)
        its prefill node does not (TokenDelta.grammar_missed:  -> forgotten: its next request
          the decode node prefilled it itself)                    is new
    new, the key below both limits                             NEW: counted, its nodes compile
    new, ``concurrent`` of the key's NEW requests compiling    429, Retry-After: RETRY_AFTER_S
    new, ``per_minute`` counted in the last minute             429, Retry-After: until the
                                                                  oldest is a minute old

A NEW request compiles on one decode node and its prefill node: all its prompts go to its
first prompt's nodes (completions.py ``start_all``), and it holds the key's compile slot
until each of its legs has its first token (its prefill node compiled before that) or
ended. So a key holds at most ``concurrent`` of a node's compile workers, and spends at most
``per_minute`` compiles of a decode node and of a prefill node a minute, whatever other
keys do. A leg moved to another decode node after its node failed (streams/migration.py)
compiles there uncounted: a key cannot make a node fail. Must not read bodies or know nodes.
"""

from __future__ import annotations

import enum
import hashlib
import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ...common.grammar_limits import MAX_CACHED_GRAMMARS
from ...common.protocol import GRAMMAR_NOT_COMPILED
from ...common.sampling_params import SamplingParams
from ..errors import ApiError

WINDOW_S = 60.0
RETRY_AFTER_S = 1  # a key at its concurrency limit: one of its compiles ends within seconds
REJECTION_REASON = "schema_compiles"  # the admission-rejections metric's label (metric_names)
T = TypeVar("T")


class CompileAdmit(enum.Enum):
    NONE = "none"  # no constraint
    KNOWN = "known"  # a node answered it before: its nodes may not compile it, not counted
    SHARED = "shared"  # another request in flight brings it: the same
    NEW = "new"  # counted: its nodes may compile it
    CONCURRENT = "concurrent"  # the key has `concurrent` NEW requests compiling: 429
    RATE = "rate"  # the key spent `per_minute` in the last minute: 429


@dataclass(slots=True)
class _Key:
    inflight: int = 0  # NEW requests of this key still compiling
    recent: deque[float] = field(default_factory=deque)  # when each counted one of the last minute came


@dataclass(slots=True)
class CompileGrant:
    """One request's admission: whether its nodes may compile its grammar (``compile``), and
    the tickets of its legs (``ticket``). A NEW grant holds its key's compile slot while the
    start or a ticket holds it (``holds``)."""
    admit: CompileAdmit
    budget: CompileBudget | None = None  # None: no constraint, nothing to settle
    digest: bytes = b""
    owner: str | None = None
    holds: int = 0

    @property
    def compile(self) -> bool:
        return self.admit in (CompileAdmit.NONE, CompileAdmit.NEW)

    def ticket(self) -> _Ticket:
        """A leg's ticket (settled by the dispatcher: its first token or its end)."""
        if self.admit is CompileAdmit.NEW:
            self.holds += 1
        return _Ticket(self)

    def let_go(self, grammar_missed: bool = False) -> None:
        """One holder is done; ``grammar_missed``: a prefill node did not hold the grammar."""
        if self.budget is None:
            return
        if grammar_missed:
            self.budget.forget(self.digest)
        if self.admit is CompileAdmit.NEW:
            self.holds -= 1
            if self.holds == 0:
                self.budget.release(self.owner)


@dataclass(slots=True)
class _Ticket:
    """A leg's part in a `CompileGrant` (streams/leg.py CompileTicket)."""
    grant: CompileGrant
    settled: bool = False

    def settle(self, grammar_missed: bool) -> None:
        if not self.settled:
            self.settled = True
            self.grant.let_go(grammar_missed)


NO_CONSTRAINT = CompileGrant(CompileAdmit.NONE)


class CompileBudget:
    def __init__(self, concurrent: int, per_minute: int, on_reject: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``on_reject``: counts a 429 (the router's admission-rejections metric)."""
        self.concurrent, self.per_minute = concurrent, per_minute
        self._on_reject = on_reject
        self._clock = clock
        self._known: OrderedDict[bytes, None] = OrderedDict()  # digests nodes answered, LRU
        self._inflight: dict[bytes, int] = {}  # digest -> its requests starting
        self._keys: dict[str | None, _Key] = {}

    async def start(self, owner: str | None, params: SamplingParams,
                    start: Callable[[CompileGrant], Awaitable[T]]) -> T:
        """``start(grant)``: the request started on its nodes under ``owner``'s budget.
        Raises a 429 `ApiError` when the compile it needs is past the budget, else what
        ``start`` raises; a 4xx of a node (a refused constraint) makes it known too."""
        so = params.structured_outputs
        if so is None:
            return await start(NO_CONSTRAINT)
        spec = so.spec()
        digest = hashlib.sha256(f"{spec.kind.value}\0{int(spec.any_whitespace)}\0{spec.source}".encode()).digest()
        if digest in self._known or digest in self._inflight:
            known = digest in self._known
            if known:
                self._known.move_to_end(digest)
            try:
                return await self._run(CompileGrant(CompileAdmit.KNOWN if known else CompileAdmit.SHARED, self,
                                                    digest, owner), start)
            except ApiError as e:
                if not _not_compiled(e):  # else its decode node does not hold it (others may):
                    raise                 # compiling it there is a compile
        key = self._keys.setdefault(owner, _Key())
        outcome = self._admit(key)
        if outcome is not CompileAdmit.NEW:
            raise self._refusal(key, outcome)
        key.inflight += 1
        key.recent.append(self._clock())
        grant = CompileGrant(CompileAdmit.NEW, self, digest, owner, holds=1)
        try:
            return await self._run(grant, start)
        except ApiError as e:
            if _not_compiled(e):  # a prompt's pinned nodes went away while it started
                raise ApiError(503, "the nodes compiling this request's structured-output constraint went away; "
                               "retry", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            raise
        finally:
            grant.let_go()  # the start's hold; the legs' tickets hold it on

    async def _run(self, grant: CompileGrant, start: Callable[[CompileGrant], Awaitable[T]]) -> T:
        digest = grant.digest
        self._inflight[digest] = self._inflight.get(digest, 0) + 1
        answered = False
        try:
            result = await start(grant)
            answered = True
            return result
        except ApiError as e:
            answered = 400 <= e.status < 500 and not _not_compiled(e)
            raise
        finally:
            self._inflight[digest] -= 1
            if not self._inflight[digest]:
                del self._inflight[digest]
            if answered:
                self._known[digest] = None
                while len(self._known) > MAX_CACHED_GRAMMARS:
                    self._known.popitem(last=False)

    def forget(self, digest: bytes) -> None:
        """A node did not hold it: the next request with it is new."""
        self._known.pop(digest, None)

    def release(self, owner: str | None) -> None:
        """A NEW request of ``owner`` compiles no more."""
        key = self._keys[owner]
        key.inflight -= 1
        if key.inflight == 0 and not key.recent:
            del self._keys[owner]

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
            return ApiError(429, f"this API key already has {key.inflight} structured-output constraints "
                            f"compiling (at most {self.concurrent} at once); retry when they are done",
                            code="too_many_requests", headers={"Retry-After": str(RETRY_AFTER_S)})
        wait = max(1, math.ceil(WINDOW_S - (self._clock() - key.recent[0])))
        return ApiError(429, f"this API key had {len(key.recent)} structured-output constraints compiled in the "
                        f"last minute, at most {self.per_minute}; constraints the nodes hold compiled cost "
                        f"nothing; retry in {wait} s", code="too_many_requests",
                        headers={"Retry-After": str(wait)})


def _not_compiled(e: ApiError) -> bool:
    """A node's 409: it holds the grammar neither compiled nor compiling (compile_grammar false)."""
    return e.status == 409 and e.type == GRAMMAR_NOT_COMPILED
