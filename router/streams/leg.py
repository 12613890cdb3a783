"""A leg: one decode node's request for a generation, and this router's books on it.

    Leg           the request id on its node, the routing decision, the token stream,
                  the in-flight slots and the decision's record (set by the dispatcher
                  when it opens the leg); what the generation saw of it (first token,
                  cached tokens, whether the node finished it or broke the stream)
    InflightSlot  one request counted in the dispatcher's per-node in-flight counters
                  until released
    CompileTicket the leg's part in its request's compile grant (router/http/compile_budget.py):
                  settled at its first token or its end

A generation has one leg or, after migrations, several, one after the other
(`Generation.legs`, generation.py). The dispatcher (dispatch.py) opens a leg and is
told when it produces its first token (`Dispatcher.first_token`: the prefill slot is
released) and when the generation lets go of it (`Dispatcher.end_leg`: the stream
closed, the node's request aborted unless it finished, the slots released, the
decision settled, the compile ticket settled).

Must not release, abort or settle anything itself, or read tokens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from ..routing.decisions import DecisionRecord
from .node_client import TokenStream
from ..routing.policy import Decision


@dataclass(slots=True)
class InflightSlot:
    """One request counted in ``counts[node_id]``, and its ``num_tokens`` in
    ``tokens[node_id]``, until `release()` (idempotent). ``node_id`` None: no node
    (local prefill), nothing counted."""

    counts: Counter[str]
    tokens: Counter[str]
    node_id: str | None
    num_tokens: int = 0  # token-equivalents of prefill work, rounded
    count_request: bool = True  # False: tokens only (the request is counted by another slot)
    released: bool = False

    def __post_init__(self) -> None:
        if self.node_id is not None:
            if self.count_request:
                self.counts[self.node_id] += 1
            if self.num_tokens:  # no zero entries: release() would leave them behind
                self.tokens[self.node_id] += self.num_tokens

    def release(self) -> None:
        if self.released or self.node_id is None:
            return
        self.released = True
        for counter, amount in ((self.counts, int(self.count_request)), (self.tokens, self.num_tokens)):
            if not amount:
                continue
            counter[self.node_id] -= amount
            if counter[self.node_id] <= 0:
                del counter[self.node_id]


class CompileTicket(Protocol):
    """A leg of a request with a structured-output constraint, as its API key's compile
    budget sees it (router/http/compile_budget.py: a leg whose nodes may compile holds the
    key's compile slot until it settles)."""

    def settle(self, grammar_missed: bool) -> None:
        """The leg's first token came, or the leg ended (idempotent). ``grammar_missed``:
        its prefill node held the grammar neither compiled nor compiling and compiled
        nothing (``TokenDelta.grammar_missed``): the decode node prefilled it."""
        ...


@dataclass(slots=True)
class Leg:
    """The request as one decode node runs it (with the prefill node its decision names)."""

    request_id: str  # the id this decode node knows the request by
    decision: Decision
    stream: TokenStream
    # The prefill work in flight on the node that computes it (Decision.prefill_work),
    # until the first token; the request in flight on the decode node, until the leg ends.
    prefill_slot: InflightSlot
    decode_slot: InflightSlot
    pull_slot: InflightSlot  # its prefix pull counted on the holder (Dispatcher.pulls) until the first token
    record: DecisionRecord  # settled at the leg's end with what it delivered (or as failed)
    t_open: float  # loop time the leg's request was sent (the first leg: the HTTP request's arrival)
    ticket: CompileTicket | None = None  # a structured-output request's first legs only
    t_first: float | None = None  # loop time of its first delta
    cached_tokens: int = 0  # prompt tokens the nodes served from cache for this leg
    node_done: bool = False  # the node finished (or failed) the request itself: no abort needed
    broken: bool = False  # its decode node broke the stream: the generation moved on without it
    ended: bool = False  # let go of (Dispatcher.end_leg ran)
