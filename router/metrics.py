"""The router's Prometheus metrics, in a registry owned by one app (no module
globals, so several routers can live in one test process).

Owns metric names, labels and buckets. Must not decide when to count (callers do).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "splitserve_router_"
# Seconds. TTFT includes routing, the prefill node's queue and the KV transfer.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
# Seconds from a prompt to its Decision: hashing, the prefix-index round trip, scoring.
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 1.0)


@dataclass(slots=True)
class RouterMetrics:
    """Every collector of one router. Build with `RouterMetrics.create()`."""

    registry: CollectorRegistry
    requests: Counter  # labels endpoint, status
    failures: Counter  # labels reason
    finished: Counter  # labels finish_reason
    ttft: Histogram
    tpot: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    cached_tokens: Counter
    nodes: Gauge  # labels role
    decisions: Counter  # labels node_id, role
    local_prefill: Counter
    redis_errors: Counter  # labels op
    inflight: Gauge
    decision_seconds: Histogram
    index_lookups: Counter  # labels result: ok | error | skipped
    predicted_cached_tokens: Counter
    predictions: Counter  # labels outcome (see decisions.py)
    prediction_hit_rate: Gauge
    inflight_requests: Gauge
    admission_rejections: Counter  # labels reason: busy | draining | connections

    @classmethod
    def create(cls) -> RouterMetrics:
        r = CollectorRegistry()
        m = cls(
            registry=r,
            requests=Counter(PREFIX + "requests", "HTTP requests answered, by endpoint and status",
                             ["endpoint", "status"], registry=r),
            failures=Counter(PREFIX + "request_failures",
                             "Generations that did not complete, by reason "
                             "(node_error, node_unavailable, client_disconnect)",
                             ["reason"], registry=r),
            finished=Counter(PREFIX + "finished", "Generations finished, by finish_reason",
                             ["finish_reason"], registry=r),
            ttft=Histogram(PREFIX + "time_to_first_token_seconds",
                           "Request received -> first token from the decode node",
                           buckets=TTFT_BUCKETS, registry=r),
            tpot=Histogram(PREFIX + "time_per_output_token_seconds",
                           "Mean time between output tokens after the first, per generation",
                           buckets=TPOT_BUCKETS, registry=r),
            prompt_tokens=Counter(PREFIX + "prompt_tokens", "Prompt tokens routed", registry=r),
            generation_tokens=Counter(PREFIX + "generation_tokens", "Tokens generated",
                                      registry=r),
            cached_tokens=Counter(PREFIX + "cached_prompt_tokens",
                                  "Prompt tokens served from a node's prefix cache", registry=r),
            nodes=Gauge(PREFIX + "nodes", "Live nodes of the served model, by role", ["role"],
                        registry=r),
            decisions=Counter(PREFIX + "routing_decisions",
                              "Requests routed to a node, by node and the role it played",
                              ["node_id", "role"], registry=r),
            local_prefill=Counter(PREFIX + "local_prefill_decisions",
                                  "Requests routed with no prefill node (the decode node "
                                  "prefills)", registry=r),
            redis_errors=Counter(PREFIX + "redis_errors", "Failed Redis calls", ["op"],
                                 registry=r),
            inflight=Gauge(PREFIX + "inflight_generations", "Generations streaming now",
                           registry=r),
            decision_seconds=Histogram(PREFIX + "routing_decision_seconds",
                                       "Prompt -> routing decision (hashing, prefix-index "
                                       "lookup, scoring)", buckets=DECISION_BUCKETS, registry=r),
            index_lookups=Counter(PREFIX + "prefix_index_lookups",
                                  "Prefix-index lookups, by result (ok; error: Redis "
                                  "unreachable or slow; skipped: backing off after an error)",
                                  ["result"], registry=r),
            predicted_cached_tokens=Counter(PREFIX + "predicted_cached_prompt_tokens",
                                            "Prompt tokens the routing decisions predicted to be "
                                            "cached (compare with cached_prompt_tokens)",
                                            registry=r),
            predictions=Counter(PREFIX + "prefix_predictions",
                                "Finished generations by prediction outcome: hit (predicted > 0, "
                                "delivered >= predicted), miss (delivered < predicted: a "
                                "misprediction, e.g. a stale index entry), unseen (predicted 0, "
                                "delivered > 0), none (both 0)", ["outcome"], registry=r),
            prediction_hit_rate=Gauge(PREFIX + "prefix_prediction_hit_rate",
                                      "hit / (hit + miss) since start", registry=r),
            inflight_requests=Gauge(PREFIX + "inflight_requests",
                                    "Generating HTTP requests being served (admission counts "
                                    "these against --max-inflight)", registry=r),
            admission_rejections=Counter(PREFIX + "admission_rejections",
                                         "Requests or connections refused before any work, by "
                                         "reason (busy: 429 at --max-inflight; draining: 503 "
                                         "after SIGTERM; connections: 503 at "
                                         "--max-connections)", ["reason"], registry=r),
        )
        for role in ("prefill", "decode", "colocated"):
            m.nodes.labels(role=role).set(0)
        return m

    def render(self) -> tuple[bytes, str]:
        """(exposition text, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
