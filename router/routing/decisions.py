"""Routing decisions, predicted versus delivered: the last decisions of this router
(``GET /debug/decisions``) and the prediction metrics.

Owns the record of one decision (nodes chosen, predicted cached tokens per node and
for the decision, the decision's predicted hit by the tier holding each block, the
policy's predicted TTFT, how long deciding took) and its
settlement once the response reported the cached tokens it really got and its
first token came (delivered TTFT). Must not route or talk to nodes.

Outcome of a settled decision with a prediction (predicted P, delivered D)::

    hit     P > 0 and D >= P
    miss    D < P        a misprediction (a stale index entry, an eviction since):
                         counted, never an error
    unseen  P == 0 < D   a hit the index did not know about (not yet published)
    none    P == D == 0
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from ...common.outcomes import PredictionOutcome, PrefixReuse
from ..metrics import RouterMetrics
from .policy import Decision
from .prefix_mirror import PrefixHits
from ...common.kv_events import TIER_NAMES
from .tier_cost import TierBlocks

log = logging.getLogger(__name__)

KEEP = 256  # decisions kept for /debug/decisions


@dataclass(slots=True)
class DecisionRecord:
    request_id: str | None  # None as /debug/decisions shows it without the cluster token
    ts: float  # unix time of the decision
    policy: str
    prefill: str | None  # node id; None: the decode node prefills
    decode: str
    prompt_tokens: int
    # The cached prompt tokens the response should report: the prefilling node's hit.
    # None: no prediction (a load-only policy, or the index was unreachable).
    predicted_cached_tokens: int | None
    # Its blocks by the tier that holds each on that node: {"device": n, "host": m, "disk": k}.
    # None: no prediction.
    predicted_hit_blocks_by_tier: dict[str, int] | None
    node_cached_tokens: dict[str, int]  # node_id -> predicted cached tokens (hits only)
    decision_s: float
    # Where the prompt's predicted hit comes from: none, the computing node's own cache, or a
    # pull from ``pull_from`` (its predicted ``predicted_cached_tokens``; node/kv_pull.py).
    reuse: PrefixReuse = PrefixReuse.NONE
    pull_from: str | None = None
    # The policy's TTFT prediction: token-equivalents, and seconds when it knows the rate.
    predicted_ttft: float | None = None
    predicted_ttft_s: float | None = None
    delivered_cached_tokens: int | None = None  # set when the generation finished
    delivered_ttft_s: float | None = None  # router-measured, request start -> first token
    outcome: PredictionOutcome | None = None


def predicted_cached(decision: Decision, hits: PrefixHits | None) -> int | None:
    """What the response will report if the index is right: the prompt tokens the node
    that prefills (the prefill node, or the decode node without one) does not compute.
    A decode node's own hit only saves sending blocks."""
    if hits is None or not hits.looked_up:
        return None
    if decision.pull is not None:
        return decision.pull.tokens
    return hits.cached.get((decision.prefill or decision.decode).node_id, 0)


def predicted_split(decision: Decision, hits: PrefixHits | None) -> TierBlocks | None:
    """``predicted_cached``'s blocks by the tier holding each; None: no prediction."""
    if hits is None or not hits.looked_up:
        return None
    return hits.tiers.get((decision.pull.holder if decision.pull is not None else
                           decision.prefill or decision.decode).node_id, TierBlocks())


@dataclass(slots=True)
class DecisionLog:
    metrics: RouterMetrics
    records: deque = field(default_factory=lambda: deque(maxlen=KEEP))  # DecisionRecord, oldest first
    hits: int = 0
    misses: int = 0

    def record(self, request_id: str, policy: str, decision: Decision, prompt_tokens: int,
               hits: PrefixHits | None, decision_s: float) -> DecisionRecord:
        predicted = predicted_cached(decision, hits)
        split = predicted_split(decision, hits)
        rec = DecisionRecord(
            request_id=request_id, ts=time.time(), policy=policy,
            prefill=decision.prefill.node_id if decision.prefill else None,
            decode=decision.decode.node_id, prompt_tokens=prompt_tokens,
            predicted_cached_tokens=predicted,
            predicted_hit_blocks_by_tier=None if split is None else split.by_tier(),
            node_cached_tokens=dict(hits.cached) if hits is not None else {},
            decision_s=decision_s,
            predicted_ttft=None if decision.predicted_ttft is None else round(decision.predicted_ttft, 1),
            predicted_ttft_s=decision.predicted_ttft_s,
            reuse=(PrefixReuse.PULL if decision.pull is not None else PrefixReuse.OWN if predicted
                   else PrefixReuse.NONE),
            pull_from=decision.pull.holder.node_id if decision.pull is not None else None)
        self.records.append(rec)
        if predicted:
            for tier, tokens in zip(TIER_NAMES, _tokens_by_tier(predicted, split)):
                if tokens:
                    self.metrics.predicted_cached_tokens.labels(tier).inc(tokens)
        return rec

    def settle(self, rec: DecisionRecord, delivered: int | None, ttft_s: float | None = None) -> None:
        """The generation of ``rec`` ended; ``delivered``: the cached tokens it
        reported, None when it failed (no outcome counted); ``ttft_s``: its TTFT."""
        if delivered is None:
            rec.outcome = PredictionOutcome.FAILED
            return
        rec.delivered_cached_tokens = delivered
        rec.delivered_ttft_s = ttft_s
        predicted = rec.predicted_cached_tokens
        if predicted is None:
            return
        if delivered < predicted:
            outcome = PredictionOutcome.MISS
            self.misses += 1
            log.debug("router: request %s mispredicted: %d cached tokens predicted on %s/%s, "
                      "%d delivered", rec.request_id, predicted, rec.prefill, rec.decode, delivered)
        elif predicted > 0:
            outcome = PredictionOutcome.HIT
            self.hits += 1
        else:
            outcome = PredictionOutcome.UNSEEN if delivered > 0 else PredictionOutcome.NONE
        rec.outcome = outcome
        self.metrics.predictions.labels(outcome=outcome).inc()
        if self.hits + self.misses:
            self.metrics.prediction_hit_rate.set(self.hits / (self.hits + self.misses))

    def last(self, n: int) -> list[DecisionRecord]:
        """The ``n`` most recent decisions, oldest first."""
        return list(self.records)[-n:] if n > 0 else []


def _tokens_by_tier(tokens: int, split: TierBlocks | None) -> tuple[int, int, int]:
    """A hit's ``tokens`` shared out as ``split`` shares its blocks (all on the device
    without one)."""
    if split is None or not split.total:
        return tokens, 0, 0
    host, disk = tokens * split.host // split.total, tokens * split.disk // split.total
    return tokens - host - disk, host, disk
