"""One prompt's generation on a decode node, as the router sees it: token deltas in,
`Piece`s of text out.

Owns detokenization and stop strings for one choice, its usage counts, its TTFT /
TPOT / token metrics, and its end: `close()` (idempotent, safe while the handler is
being cancelled) releases the stream and, unless the node already finished the
request, aborts it there (in a background task, since the caller may be cancelled).
A stop string ends the choice with finish_reason "stop" and aborts it on the node.

The node side is a `Leg` (one decode node's request, its token stream, its in-flight
slots, its routing decision). A generation has one, or, when its decode node breaks
the stream and ``migrate`` (router/migration.py) finds another node, one after the
other; the detokenizer, counts and client stream carry across.

Must not format OpenAI responses (responses.py) or choose nodes (dispatch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..common.detokenizer import IncrementalDetokenizer
from ..common.outcomes import FailureReason
from ..common.sampling_params import PromptLogprob, SamplingParams, TokenLogprobs
from .errors import ApiError
from .metrics import RouterMetrics
from .node_client import NodeUnavailable, TokenStream
from .policy import Decision
from .prompt import Prompt


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


@dataclass(slots=True)
class Leg:
    """The request as one decode node runs it (with the prefill node its decision
    names). Released by `Generation`: at its first token, the prefill slot; at its
    end, the stream, the decode slot and the decision's settlement."""

    request_id: str  # the id this decode node knows the request by
    decision: Decision
    stream: TokenStream
    release_prefill: Callable[[], None]  # the prefill node's in-flight slot (idempotent)
    release_decode: Callable[[], None]  # the decode node's in-flight slot (idempotent)
    # (cached tokens, TTFT s), once at the leg's end; cached None: it did not finish.
    # Settles the routing decision's prediction.
    settle: Callable[[int | None, float | None], None] | None
    t_open: float  # loop time the leg's request was sent (the first leg: the HTTP request's arrival)
    t_first: float | None = None  # loop time of its first delta
    cached_tokens: int = 0  # prompt tokens the nodes served from cache for this leg
    node_done: bool = False  # the node finished the request itself: no abort needed


@dataclass(slots=True)
class Generation:
    index: int  # choice index in the response
    request_id: str  # this choice's id; the first leg's id on its node
    prompt: Prompt  # the client's prompt
    params: SamplingParams
    leg: Leg  # the decode node generating now
    detok: IncrementalDetokenizer
    metrics: RouterMetrics
    abort: Callable[[str, str], None]  # (node addr, request_id) -> schedules an abort
    t_start: float  # loop time the HTTP request arrived
    # (generation, the leg's failure) -> True when it continues on a new leg
    # (router/migration.py); None: a broken stream fails the generation.
    migrate: Callable[[Generation, NodeUnavailable], Awaitable[bool]] | None = None
    score_only: bool = False  # max_tokens 0: the node's one token is dropped (prompt scoring)
    output_ids: list[int] = field(default_factory=list)  # every token received, in order
    migrations: int = 0  # legs after the first
    failed_nodes: tuple[str, ...] = ()  # decode node ids whose legs broke (not tried again)
    cached_tokens: int = 0  # the first leg's (usage: the client's prompt)
    finish_reason: str | None = None
    closed: bool = False
    _t_first: float | None = None
    _t_last: float = 0.0
    _failure: FailureReason | None = None  # why it failed, for the metrics

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
                if self.closed or self.migrate is None or not await self.migrate(self, e):
                    self._failure = FailureReason.NODE_UNAVAILABLE
                    raise ApiError(502, str(e)) from e

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
                    leg.release_prefill()
                if self._t_first is None:
                    self._t_first = now
                    self.metrics.ttft.observe(now - self.t_start)
                elif delta.token_ids:
                    for _ in delta.token_ids:  # a frame of k tokens: k gaps of equal share
                        self.metrics.itl.observe((now - self._t_last) / len(delta.token_ids))
                self._t_last = now
                leg.cached_tokens = max(leg.cached_tokens, delta.num_cached_tokens)
                if not self.migrations:
                    self.cached_tokens = leg.cached_tokens
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

    def end_leg(self) -> None:
        """Let go of the current leg: release its stream, abort the request on its node
        unless the node finished it, free its in-flight slots, settle its decision
        (as failed unless the generation finished on it). Idempotent per leg."""
        leg = self.leg
        leg.stream.close()
        if not leg.node_done:
            leg.node_done = True  # one abort per leg
            self.abort(leg.decision.decode.http_addr, leg.request_id)
        leg.release_prefill()
        leg.release_decode()
        if leg.settle is not None:
            if self.finish_reason is not None and leg.t_first is not None:
                leg.settle(leg.cached_tokens, leg.t_first - leg.t_open)
            else:
                leg.settle(None, None)
            leg.settle = None

    def close(self, client_gone: bool = False) -> None:
        """End the generation: release the stream, abort the request on the node if it
        is still running there, count metrics. Idempotent; never blocks."""
        if self.closed:
            return
        self.closed = True
        self.end_leg()
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
