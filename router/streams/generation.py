"""One prompt's generation, as the router sees it: token deltas in from its legs,
`Piece`s of text out.

Owns detokenization and stop strings for one choice, its usage counts, its TTFT /
TPOT / token metrics, its legs, and its end: `close()` (idempotent, safe while the
handler is being cancelled) lets go of the current leg, which aborts the request on
its node unless the node already finished it (in a background task, since the
caller may be cancelled). A stop string ends the choice with finish_reason "stop"
and aborts it on the node.

A leg (leg.py) is one decode node's request. A generation has one or, when a decode
node breaks the stream and migration is on, one after the other (``legs``, in
order); the detokenizer, counts and client stream carry across. Only the generation
changes its legs: ``new_leg`` ends the broken one, records its node as failed and
installs the next (migration.py has the contract and the continuation). The
dispatcher keeps the books of every leg, told by the generation when it sees the
events: `LegDispatch.first_token`, `LegDispatch.end_leg`.

Must not format OpenAI bodies (bodies.py) or choose nodes (dispatch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ...common.detokenizer import IncrementalDetokenizer
from ...common.outcomes import FailureReason
from ...common.sampling_params import PromptLogprob, SamplingParams, TokenLogprobs
from ..errors import ApiError
from .leg import Leg
from ..metrics import RouterMetrics
from .migration import Continuation, continuation
from .node_client import NodeUnavailable
from ..prompt import Prompt

log = logging.getLogger(__name__)


class Piece(NamedTuple):
    """Something to send for choice number ``choice``: new text, the tokens that produced it,
    and the finish reason on the last piece."""

    choice: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    finish_reason: str | None
    # on the choice's first piece, when the request asked for them: one per prompt token
    prompt_logprobs: list[PromptLogprob | None] | None = None


class LegDispatch(Protocol):
    """What a generation asks of the dispatcher (dispatch.Dispatcher), which opens its
    legs and keeps their books: this router's in-flight counts per node, the decision
    log, aborts on the nodes."""

    async def open(self, request_id: str, prompt: Prompt, params: SamplingParams, t_open: float,
                   exclude: frozenset[str] = ...) -> Leg:
        """Route the request to a decode node not in ``exclude`` (node ids) and send it;
        raises `ApiError` when no node takes it."""
        ...

    def first_token(self, leg: Leg, grammar_missed: bool = False) -> None:
        """``leg`` produced its first token (``grammar_missed``: its first frame's)."""
        ...

    def end_leg(self, leg: Leg, finished: bool) -> None:
        """Let go of ``leg`` (idempotent); ``finished``: the generation finished on it."""
        ...


@dataclass(slots=True)
class Generation:
    index: int  # choice index in the response
    request_id: str  # this choice's id; the first leg's id on its node
    prompt: Prompt  # the client's prompt
    params: SamplingParams
    legs: list[Leg]  # every leg, in order; the last one is generating now
    detok: IncrementalDetokenizer
    metrics: RouterMetrics
    dispatch: LegDispatch  # opens the legs and keeps their books
    t_start: float  # loop time the HTTP request arrived
    migration_limit: int = 0  # legs it may move to after the first (0: a broken stream fails it)
    score_only: bool = False  # max_tokens 0: the node's one token is dropped (prompt scoring)
    output_ids: list[int] = field(default_factory=list)  # every token received, in order
    finish_reason: str | None = None
    closed: bool = False
    _t_first: float | None = None
    _t_last: float = 0.0
    _failure: FailureReason | None = None  # why it failed, for the metrics

    def __post_init__(self) -> None:
        assert self.legs, "a generation starts on a leg"
        self.metrics.inflight.inc()  # close() decrements

    @property
    def leg(self) -> Leg:
        """The leg generating now."""
        return self.legs[-1]

    @property
    def migrations(self) -> int:
        """Legs after the first."""
        return len(self.legs) - 1

    @property
    def failed_nodes(self) -> frozenset[str]:
        """The decode node ids whose legs broke the stream (not tried again)."""
        return frozenset(leg.decision.decode.node_id for leg in self.legs if leg.broken)

    @property
    def cached_tokens(self) -> int:
        """The first leg's (usage: the client's prompt)."""
        return self.legs[0].cached_tokens

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """The choice's pieces; the last one has a finish_reason. Raises `ApiError`
        (502) when the node fails mid-stream and no migration takes over."""
        while True:
            try:
                async with contextlib.aclosing(self._leg_pieces()) as pieces:
                    async for piece in pieces:
                        yield piece
                return
            except NodeUnavailable as e:
                if self.closed or not await self._migrate(e):
                    self._failure = FailureReason.NODE_UNAVAILABLE
                    raise ApiError(502, str(e)) from e

    async def _migrate(self, error: NodeUnavailable) -> bool:
        """Continue on another decode node after the current leg's node broke the stream
        with ``error`` (migration.py). False when migration is off or at its limit, every
        token already arrived, or no node took the new leg: the caller then fails the
        generation (its close() ends whatever leg it holds)."""
        if self.migrations >= self.migration_limit:
            if self.migration_limit:
                log.warning("router: %s: not migrated (limit %d reached): %s", self.request_id,
                            self.migration_limit, error)
            return False
        request = continuation(self.request_id, self.migrations + 1, self.prompt, self.params,
                               self.output_ids)
        if request is None:
            return False
        failed = self.leg.decision.decode.node_id
        try:
            leg = await self.new_leg(request)
        except ApiError as e:
            log.warning("router: %s: migration off %s failed (%s) after: %s", self.request_id,
                        failed, e.message, error)
            return False
        self.metrics.migrations.inc()
        log.info("router: %s migrated from %s to %s after %d tokens (%s)", self.request_id,
                 failed, leg.decision.decode.node_id, self.completion_tokens, error)
        return True

    async def new_leg(self, request: Continuation) -> Leg:
        """Replace the current leg, whose decode node broke the stream, with ``request``
        on another decode node: end the broken leg (as failed), record its node as
        failed, open the new one through the dispatcher avoiding every failed node, and
        make it the current leg. Raises `ApiError` when no node takes it; the broken
        leg then stays the last one, already ended."""
        broken = self.leg
        broken.broken = True
        self.dispatch.end_leg(broken, finished=False)
        leg = await self.dispatch.open(request.request_id, request.prompt, request.params,
                                       asyncio.get_running_loop().time(), self.failed_nodes)
        self.legs.append(leg)
        return leg

    async def _leg_pieces(self) -> AsyncGenerator[Piece, None]:
        """The pieces of the current leg; raises `NodeUnavailable` when its node breaks
        the stream, `ApiError` when the node reports a failure."""
        loop = asyncio.get_running_loop()
        leg = self.leg
        async with contextlib.aclosing(leg.stream.deltas()) as deltas:
            async for delta in deltas:
                if delta.error is not None or delta.finish_reason in ("error", "abort"):
                    leg.node_done = delta.finish_reason is not None
                    self._failure = FailureReason.NODE_ERROR
                    raise ApiError(502, f"decode node {leg.decision.decode.node_id} failed the "
                                   f"request: {delta.error or delta.finish_reason}")
                now = loop.time()
                if leg.t_first is None:
                    leg.t_first = now
                    self.dispatch.first_token(leg, delta.grammar_missed)
                if self._t_first is None:
                    self._t_first = now
                    self.metrics.ttft.observe(now - self.t_start)
                elif delta.token_ids:
                    for _ in delta.token_ids:  # a frame of k tokens: k gaps of equal share
                        self.metrics.itl.observe((now - self._t_last) / len(delta.token_ids))
                self._t_last = now
                leg.cached_tokens = max(leg.cached_tokens, delta.num_cached_tokens)
                if self.score_only:  # the prompt was the point: nothing generated is shown
                    leg.node_done = delta.finish_reason is not None
                    self.finish_reason = "length"
                    self.metrics.finished.labels(finished_reason="length").inc()
                    yield Piece(self.index, "", [], [], "length", delta.prompt_logprobs)
                    return
                self.output_ids += delta.token_ids
                step = self.detok.add_tokens(delta.token_ids)
                text, finish = step.new_text, None
                if step.stop_string is not None:
                    finish = "stop"  # the node keeps going until close() aborts it
                elif delta.finish_reason is not None:
                    leg.node_done = True
                    text += self.detok.flush()
                    finish = "stop" if self.detok.stop_string is not None else delta.finish_reason
                if text or finish or delta.logprobs or delta.prompt_logprobs:
                    yield Piece(self.index, text, delta.token_ids, delta.logprobs, finish,
                                delta.prompt_logprobs)
                if finish is not None:
                    self.finish_reason = finish
                    self.metrics.finished.labels(finished_reason=finish).inc()
                    return

    def close(self, client_gone: bool = False) -> None:
        """End the generation: let go of its current leg (`LegDispatch.end_leg`: the
        stream released, the request aborted on its node if it still runs there), count
        metrics. Idempotent; never blocks."""
        if self.closed:
            return
        self.closed = True
        self.dispatch.end_leg(self.leg, finished=self.finish_reason is not None)
        m = self.metrics
        m.inflight.dec()
        m.generation_tokens.inc(self.completion_tokens)
        m.cached_tokens.inc(self.cached_tokens)
        if self.finish_reason is None:
            m.failures.labels(reason=FailureReason.CLIENT_DISCONNECT if client_gone
                              else self._failure or FailureReason.CANCELLED).inc()
        elif self._t_first is not None:
            m.e2e.observe(self._t_last - self.t_start)
            m.request_prompt_tokens.observe(self.prompt_len)
            m.request_generation_tokens.observe(self.completion_tokens)
            if self.completion_tokens >= 2:
                m.tpot.observe((self._t_last - self._t_first) / (self.completion_tokens - 1))


async def merge_pieces(gens: list[Generation]) -> AsyncGenerator[Piece, None]:
    """The pieces of every generation, interleaved as they arrive (each choice's own
    pieces stay in order). The first failure is raised; the rest are then stopped."""
    if len(gens) == 1:
        async for piece in gens[0].pieces():
            yield piece
        return
    queue: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()

    async def pump(g: Generation) -> None:
        try:
            async for piece in g.pieces():
                queue.put_nowait(piece)
        except Exception as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)  # this generation is done

    tasks = [asyncio.get_running_loop().create_task(pump(g)) for g in gens]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
