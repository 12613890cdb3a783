"""The router's Prometheus metrics, in a collector registry owned by one app (no module
globals, so several routers can live in one test process). Every series carries
``model_name``; the names are vLLM's with our prefix (common/metric_names.py).

Owns the collectors, their help texts and buckets. Must not decide when to count (callers do).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common import metric_names as n
from prometheus_client import Counter, Gauge, Histogram

from ..common.model_metrics import BoundLabels, ModelMetrics
from ..common.outcomes import FailureReason, IndexLookupResult, PredictionOutcome, StoreResult
from .loop_lag import LAG_BUCKETS, LAG_PERIOD_S
from ..common.kv_events import TIER_NAMES

# Seconds. TTFT includes routing, the prefill node's queue and the KV transfer. (vLLM's buckets,
# cut below 10 ms.)
TTFT_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
# Seconds between two output tokens (ITL) or their mean over a request (TPOT).
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)
# Seconds from a prompt to its Decision: hashing, the prefix mirror's lookup, scoring.
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 1.0)


@dataclass(slots=True)
class RouterMetrics:
    """Every collector of one router, model_name bound. Build with `RouterMetrics.create()`."""

    collectors: ModelMetrics
    requests: BoundLabels[Counter]  # labels endpoint, status
    failures: BoundLabels[Counter]  # labels reason
    finished: BoundLabels[Counter]  # labels finished_reason
    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    cached_tokens: Counter  # delivered prefix hits, prompt tokens
    nodes: BoundLabels[Gauge]  # labels role
    decisions: BoundLabels[Counter]  # labels node_id, role
    local_prefill: Counter
    redis_errors: BoundLabels[Counter]  # labels op
    inflight: Gauge
    decision_seconds: Histogram
    loop_lag: Histogram  # loop_lag.py
    index_lookups: BoundLabels[Counter]  # labels result: ok | error | skipped
    predicted_cached_tokens: BoundLabels[Counter]  # labels tier: device | host | disk
    predictions: BoundLabels[Counter]  # labels outcome (see decisions.py)
    prediction_hit_rate: Gauge
    inflight_requests: Gauge  # generating HTTP requests admitted (admission.py)
    admission_rejections: BoundLabels[Counter]  # labels reason (n.ADMISSION_REJECTION_REASONS)
    migrations: Counter  # generations moved mid-stream to another decode node (migration.py)
    responses_stored: BoundLabels[Counter]  # labels result (StoreResult): /v1/responses kept or refused

    @classmethod
    def create(cls, model_name: str) -> RouterMetrics:
        c = ModelMetrics({n.MODEL_LABEL: model_name})
        m = cls(
            collectors=c,
            requests=c.counter(n.HTTP_REQUESTS, "HTTP requests answered, by endpoint and status",
                               ["endpoint", "status"]),
            failures=c.counter(n.REQUEST_FAILURES, "Generations that did not complete, by reason "
                               "(node_error, node_unavailable, client_disconnect, cancelled)",
                               ["reason"]),
            finished=c.counter(n.REQUEST_SUCCESS, "Generations finished, by finished_reason",
                               [n.FINISHED_REASON_LABEL]),
            ttft=c.histogram(n.TIME_TO_FIRST_TOKEN, "Request received -> first token from the "
                             "decode node", TTFT_BUCKETS),
            itl=c.histogram(n.INTER_TOKEN_LATENCY, "Time between two consecutive output tokens",
                            TPOT_BUCKETS),
            tpot=c.histogram(n.TIME_PER_OUTPUT_TOKEN, "Mean time between output tokens after the "
                             "first, per finished generation", TPOT_BUCKETS),
            e2e=c.histogram(n.E2E_REQUEST_LATENCY, "Request received -> last token, per finished "
                            "generation", E2E_BUCKETS),
            request_prompt_tokens=c.histogram(n.REQUEST_PROMPT_TOKENS, "Prompt tokens per "
                                              "finished generation", TOKEN_BUCKETS),
            request_generation_tokens=c.histogram(n.REQUEST_GENERATION_TOKENS, "Output tokens per "
                                                  "finished generation", TOKEN_BUCKETS),
            prompt_tokens=c.counter(n.PROMPT_TOKENS, "Prompt tokens routed"),
            generation_tokens=c.counter(n.GENERATION_TOKENS, "Tokens generated"),
            cached_tokens=c.counter(n.DELIVERED_CACHED_TOKENS, "Prompt tokens the nodes served from "
                                    "their prefix cache (delivered hits)"),
            nodes=c.gauge(n.ROUTER_NODES, "Live nodes of the served model, by role", ["role"]),
            decisions=c.counter(n.ROUTING_DECISIONS, "Requests routed to a node, by node and the "
                                "role it played", ["node_id", "role"]),
            local_prefill=c.counter(n.LOCAL_PREFILL_DECISIONS, "Requests routed with no prefill "
                                    "node (the decode node prefills)"),
            redis_errors=c.counter(n.REDIS_ERRORS, "Failed Redis calls", ["op"]),
            inflight=c.gauge(n.ROUTER_RUNNING, "Generations streaming now"),
            decision_seconds=c.histogram(n.ROUTING_DECISION_SECONDS, "Prompt -> routing decision "
                                         "(hashing, prefix mirror lookup, scoring)",
                                         DECISION_BUCKETS),
            loop_lag=c.histogram(n.ROUTER_EVENT_LOOP_LAG, "How late the event loop woke a "
                                 f"{LAG_PERIOD_S}s timer (a stall delays every stream)", LAG_BUCKETS),
            index_lookups=c.counter(n.PREFIX_INDEX_LOOKUPS, "Lookups in the router's prefix "
                                    "mirror (its in-memory copy of the prefix index), by result "
                                    "(ok; skipped: the mirror is not usable, Redis unreachable: "
                                    "routing by load only)", ["result"]),
            predicted_cached_tokens=c.counter(n.PREDICTED_CACHED_TOKENS, "Prompt tokens the routing "
                                              "decisions predicted to be cached, by the tier of "
                                              "the node's prefix cache holding them (device, "
                                              "host, disk; compare their sum with "
                                              + n.DELIVERED_CACHED_TOKENS + ")", ["tier"]),
            predictions=c.counter(n.PREFIX_PREDICTIONS, "Finished generations by prediction "
                                  "outcome: hit (predicted > 0, delivered >= predicted), miss "
                                  "(delivered < predicted: a misprediction, e.g. a stale index "
                                  "entry), unseen (predicted 0, delivered > 0), none (both 0)",
                                  ["outcome"]),
            prediction_hit_rate=c.gauge(n.PREFIX_PREDICTION_HIT_RATE, "hit / (hit + miss) since "
                                        "start"),
            inflight_requests=c.gauge(n.ROUTER_INFLIGHT_REQUESTS, "Generating HTTP requests being "
                                      "served (admission counts these against --max-inflight)"),
            admission_rejections=c.counter(n.ADMISSION_REJECTIONS, "Requests or connections "
                                           "refused before any work, by reason (busy: 429 at "
                                           "--max-inflight; draining: 503 after SIGTERM; "
                                           "connections: 503 at --max-connections)", ["reason"]),
            migrations=c.counter(n.REQUEST_MIGRATIONS, "Generations moved mid-stream to another "
                                 "decode node after theirs failed (--migration-limit)"),
            responses_stored=c.counter(n.RESPONSES_STORED, "/v1/responses to be stored, by result: "
                                       "stored; refused before or after generating (key_full, "
                                       "over_share: 429; store_full: 503); too_large and "
                                       "unavailable (Redis down): not stored, answered anyway",
                                       ["result"]),
        )
        for role in ("prefill", "decode", "colocated"):
            m.nodes.labels(role=role).set(0)
        counted_predictions = [o for o in PredictionOutcome if o is not PredictionOutcome.FAILED]
        for counter, values in ((m.finished, n.FINISHED_REASONS), (m.failures, FailureReason),
                                (m.redis_errors, n.REDIS_OPS), (m.index_lookups, IndexLookupResult),
                                (m.predictions, counted_predictions),
                                (m.predicted_cached_tokens, TIER_NAMES),
                                (m.admission_rejections, n.ADMISSION_REJECTION_REASONS),
                                (m.responses_stored, StoreResult)):
            for value in values:
                counter.labels(value)  # exported at 0 from the start
        return m

    def render(self) -> tuple[bytes, str]:
        """(exposition text, its content type)."""
        return self.collectors.render()
