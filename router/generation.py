"""One prompt's generation on a decode node, as the router sees it: token deltas in,
`Piece`s of text out.

Owns detokenization and stop strings for one choice, its usage counts, its TTFT /
TPOT / token metrics, and its end: `close()` (idempotent, safe while the handler is
being cancelled) releases the stream and, unless the node already finished the
request, aborts it there (in a background task, since the caller may be cancelled).
A stop string ends the choice with finish_reason "stop" and aborts it on the node.

Must not format OpenAI responses (responses.py) or choose nodes (dispatch.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import NamedTuple

from ..common.detokenizer import IncrementalDetokenizer
from ..common.outcomes import FailureReason
from ..common.sampling_params import TokenLogprobs
from .errors import ApiError
from .metrics import RouterMetrics
from .node_client import NodeUnavailable, TokenStream
from .policy import Decision


class Piece(NamedTuple):
    """Something to send for choice ``index``: new text, the tokens that produced it,
    and the finish reason on the last piece."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    finish_reason: str | None


@dataclass(slots=True)
class Generation:
    index: int  # choice index in the response
    request_id: str  # the id the decode node knows the request by
    prompt_len: int
    decision: Decision
    stream: TokenStream
    detok: IncrementalDetokenizer
    metrics: RouterMetrics
    abort: Callable[[str, str], None]  # (node addr, request_id) -> schedules an abort
    on_first_token: Callable[[], None]  # releases the prefill node's in-flight slot
    on_close: Callable[[], None]  # releases the decode node's in-flight slot
    t_start: float  # loop time the HTTP request arrived
    # Called once by close() with the cached tokens reported (None: it did not finish):
    # settles the routing decision's prediction.
    on_settle: Callable[[int | None, float | None], None] | None = None  # (cached tokens, TTFT s)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    closed: bool = False
    _t_first: float | None = None
    _t_last: float = 0.0
    _node_done: bool = False  # the node finished the request itself: no abort needed
    _failure: FailureReason | None = None  # why it failed, for the metrics

    async def pieces(self) -> AsyncIterator[Piece]:
        """The choice's pieces; the last one has a finish_reason. Raises `ApiError`
        (502) when the node fails mid-stream."""
        loop = asyncio.get_running_loop()
        deltas = self.stream.deltas()
        try:
            async for delta in deltas:
                if delta.error is not None or delta.finish_reason in ("error", "abort"):
                    self._node_done = delta.finish_reason is not None
                    self._failure = FailureReason.NODE_ERROR
                    raise ApiError(502, f"decode node {self.decision.decode.node_id} failed the "
                                   f"request: {delta.error or delta.finish_reason}")
                now = loop.time()
                if self._t_first is None:
                    self._t_first = now
                    self.metrics.ttft.observe(now - self.t_start)
                    self.on_first_token()
                elif delta.token_ids:
                    for _ in delta.token_ids:  # a frame of k tokens: k gaps of equal share
                        self.metrics.itl.observe((now - self._t_last) / len(delta.token_ids))
                self._t_last = now
                self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
                self.completion_tokens += len(delta.token_ids)
                step = self.detok.add_tokens(delta.token_ids)
                text, finish = step.new_text, None
                if step.stop_string is not None:
                    finish = "stop"  # the node keeps going until close() aborts it
                elif delta.finish_reason is not None:
                    self._node_done = True
                    text += self.detok.flush()
                    finish = "stop" if self.detok.stop_string is not None else delta.finish_reason
                if text or finish or delta.logprobs:
                    yield Piece(self.index, text, delta.token_ids, delta.logprobs, finish)
                if finish is not None:
                    self.finish_reason = finish
                    self.metrics.finished.labels(finished_reason=finish).inc()
                    return
        except NodeUnavailable as e:
            self._failure = FailureReason.NODE_UNAVAILABLE
            raise ApiError(502, str(e)) from e
        finally:
            await deltas.aclose()

    def close(self, client_gone: bool = False) -> None:
        """End the generation: release the stream, abort the request on the node if it
        is still running there, count metrics. Idempotent; never blocks."""
        if self.closed:
            return
        self.closed = True
        self.stream.close()
        if not self._node_done:
            self.abort(self.decision.decode.http_addr, self.request_id)
        if self._t_first is None:
            self.on_first_token()
        self.on_close()
        m = self.metrics
        m.inflight.dec()
        m.generation_tokens.inc(self.completion_tokens)
        m.cached_tokens.inc(self.cached_tokens)
        if self.on_settle is not None:
            ok = self.finish_reason is not None and self._t_first is not None
            self.on_settle(self.cached_tokens if ok else None,
                           self._t_first - self.t_start if ok else None)
        if self.finish_reason is None:
            m.failures.labels(reason=FailureReason.CLIENT_DISCONNECT if client_gone
                              else self._failure or FailureReason.CANCELLED).inc()
        elif self._t_first is not None:
            m.e2e.observe(self._t_last - self.t_start)
            m.request_prompt_tokens.observe(self.prompt_len)
            m.request_generation_tokens.observe(self.completion_tokens)
            if self.completion_tokens >= 2:
                m.tpot.observe((self._t_last - self._t_first) / (self.completion_tokens - 1))


async def merge_pieces(gens: list[Generation]) -> AsyncIterator[Piece]:
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
