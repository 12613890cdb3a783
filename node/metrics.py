"""NodeMetrics: every Prometheus collector of one node, ``model_name`` and ``role``
bound on each series (names in common/metric_names.py), and the per-request timing
that feeds the queue / prefill / decode time histograms.

Request timing, per request the engine runs (vLLM's engine-side intervals), all of it
taken on the engine thread by ``observe_step`` after each step:

    added --queue--> first scheduled --prefill--> prompt computed --decode--> finished
    (Request.arrival_time)

A request admitted with its prompt already computed (a KV transfer landed on a decode
node) has no queue or prefill interval here: the prefill node measured them.

Owns the collectors and that bookkeeping. Must not decide outcomes (the servers count
fallbacks, transfers and blocks through the collectors here) or touch the engine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..common import metric_names as n
from ..common.kv_events import Tier
from ..common.kv_tier_stats import TierStats
from ..common.load import NodeLoad
from ..common.model_metrics import ModelMetrics
from ..common.outcomes import (FallbackReason, PullOutcome, PullServed, GrammarCompileOutcome, IndexBatchResult, PrefillOutcome,
                               PromptHashResult, TierFault, TransferEnd, TransferStage)

if TYPE_CHECKING:  # annotations only: this module never calls the engine
    from ..engine.kv.tier_store import Move
    from ..engine.engine_core import RequestDelta
    from ..engine.request import Request
    from ..engine.scheduler import SchedulerOutput

# Seconds (vLLM's request-interval buckets, cut below 10 ms).
INTERVAL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
# Seconds of one tier move (a block is ~1 MiB here, tens of MiB for a long prompt's run on a GPU)
OFFLOAD_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PRUNE_SLACK = 64  # timing entries beyond the live requests before finished ones are dropped


@dataclass(slots=True)
class RequestTimes:
    """Monotonic times of one request (engine thread only)."""
    request: Request  # kept to notice one that finished without a delta
    scheduled: float
    first_token: float | None = None


class NodeMetrics:
    def __init__(self, model_name: str, role: str):
        c = self.collectors = ModelMetrics({n.MODEL_LABEL: model_name, n.ROLE_LABEL: role})
        # Engine state, set from the engine's load at each scrape.
        self.load = {
            "running": c.gauge(n.NUM_REQUESTS_RUNNING, "Requests in the running batch"),
            "waiting": c.gauge(n.NUM_REQUESTS_WAITING, "Requests admitted, not yet running"),
            "queued_prefill_tokens": c.gauge(n.NUM_QUEUED_PREFILL_TOKENS,
                                             "Prompt tokens admitted and not yet computed"),
            "kv_usage": c.gauge(n.KV_CACHE_USAGE, "Fraction of KV blocks in use (0..1)"),
            "kv_free_blocks": c.gauge(n.KV_FREE_BLOCKS, "Free KV blocks"),
            "generated_tokens": c.gauge(n.NUM_RUNNING_GENERATED_TOKENS,
                                        "Output tokens the running requests have produced so far"),
            "pulls_serving": c.gauge(n.KV_PULLS_SERVING, "Prefix pulls this node serves now"),
            "pull_bytes_per_s": c.gauge(n.KV_PULL_COPY_RATE, "Bytes per second this node copies blocks out "
                                        "for the pulls it serves, all together (0: not measured yet)"),
        }
        assert set(self.load) == set(NodeLoad.__struct_fields__), "a load field has no gauge"
        self.device_info = c.gauge(n.NODE_DEVICE_INFO, "The engine's device and KV dtype (value 1)",
                                   ["device", "dtype"])
        self.kv_pool = {"blocks": c.gauge(n.KV_POOL_BLOCKS, "KV block pool size in blocks"),
                        "bytes": c.gauge(n.KV_POOL_BYTES, "KV block pool size in bytes"),
                        "tokens": c.gauge(n.KV_POOL_TOKENS, "KV block pool size in tokens")}
        self.preemptions = c.counter(n.NUM_PREEMPTIONS, "Requests preempted (blocks freed, "
                                     "recomputed later)")
        self.heartbeat_failures = c.gauge(n.HEARTBEAT_FAILURES, "Consecutive failed node registry "
                                          "heartbeats (0: the router sees this node)")
        self.prefix_queries = c.counter(n.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the "
                                        "prefix cache at admission")
        self.prefix_hits = c.counter(n.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix "
                                     "cache at admission")
        self.queue_time = c.histogram(n.REQUEST_QUEUE_TIME, "Request added -> first scheduled",
                                      INTERVAL_BUCKETS)
        self.prefill_time = c.histogram(n.REQUEST_PREFILL_TIME, "First scheduled -> prompt "
                                        "computed (first token sampled)", INTERVAL_BUCKETS)
        self.decode_time = c.histogram(n.REQUEST_DECODE_TIME, "First token -> finished",
                                       INTERVAL_BUCKETS)
        # Disaggregation.
        self.index_batches = c.counter(n.KV_INDEX_BATCHES, "prefix-index writes to Redis, by "
                                       "result (ok, refused: Redis lost earlier batches, error: "
                                       "unreachable)", ["result"])
        self.prefill_requests = c.counter(n.PREFILL_REQUESTS, "prefill tasks by outcome",
                                          ["outcome"])
        self.blocks_sent = c.counter(n.KV_BLOCKS_SENT, "KV blocks sent to decode nodes")
        self.bytes_sent = c.counter(n.KV_BYTES_SENT, "KV block bytes sent to decode nodes")
        self.send_seconds = c.counter(n.KV_SEND_SECONDS, "Seconds spent sending KV blocks (each "
                                      "send: first frame out to last acknowledgement)")
        self.blocks_received = c.counter(n.KV_BLOCKS_RECEIVED, "KV blocks received", ["ok"])
        self.transfers = c.counter(n.KV_TRANSFERS, "finished KV transfers, by end state",
                                   ["state"])
        self.transfer_stages = c.histogram(n.KV_TRANSFER_STAGE_SECONDS, "Seconds of each stage of an "
                                           "owned transfer: reserve, transfer, admit", INTERVAL_BUCKETS,
                                           ["stage"])
        for stage in TransferStage:
            self.transfer_stages.labels(stage)
        self.fallbacks = c.counter(n.FALLBACK_PREFILLS, "requests prefilled locally after a "
                                   "failed or impossible transfer", ["reason"])
        self.pulls = c.counter(n.KV_PULLS, "prefix pulls this node asked for, by outcome", ["outcome"])
        self.pull_tokens = c.counter(n.KV_PULL_TOKENS, "prompt tokens whose KV this node pulled from "
                                     "another node instead of computing them")
        self.pulls_served = c.counter(n.KV_PULLS_SERVED, "prefix pulls other nodes asked of this node, by "
                                      "outcome", ["outcome"])
        self.pull_blocks_served = c.counter(n.KV_PULL_BLOCKS_SERVED, "cached KV blocks this node sent "
                                            "to nodes that pulled them")
        self.pull_packed_bytes = c.gauge(n.KV_PULL_PACKED_BYTES, "Bytes this node holds packed for the pulls "
                                         "it serves, not yet sent (at most --kv-pull-memory)")
        self.pull_copy_seconds = c.counter(n.KV_PULL_COPY_SECONDS, "Seconds this node's engine spent copying "
                                           "blocks out for pulls (lookups and lower-tier loads included)")
        self.prompt_hashes = c.counter(n.PROMPT_HASHES, "prompts by the fate of the block hashes "
                                       "the router carried (adopted; rehashed: they did not check "
                                       "out; absent: none carried)", ["result"])
        self.grammar_compiles = c.counter(n.GRAMMAR_COMPILES, "structured-output grammars a request needed, by "
                                          "outcome (cached, compiled, refused, ...)", ["outcome"])
        self.grammar_compile_seconds = c.histogram(n.GRAMMAR_COMPILE_SECONDS, "Wall seconds of one grammar "
                                                   "compile in a worker process", INTERVAL_BUCKETS)
        for counter, values in ((self.grammar_compiles, GrammarCompileOutcome),
                                (self.index_batches, IndexBatchResult),
                                (self.prefill_requests, PrefillOutcome),
                                (self.blocks_received, n.BLOCK_OK), (self.transfers, TransferEnd),
                                (self.fallbacks, FallbackReason), (self.prompt_hashes, PromptHashResult),
                                (self.pulls, PullOutcome), (self.pulls_served, PullServed)):
            for value in values:
                counter.labels(value)  # exported at 0 from the start
        # Lower tiers of the prefix cache: observed on the engine thread (tier_store.TierObserver)
        lower = [t.name.lower() for t in Tier if t is not Tier.DEVICE]
        self.tier_queries = c.counter(n.KV_OFFLOAD_QUERIES, "Prompt blocks looked up in the lower "
                                         "tiers (after the device's prefix cache missed)")
        self.tier_hits = c.counter(n.KV_OFFLOAD_HITS, "Prompt blocks found in a lower tier and "
                                      "loaded instead of recomputed", ["tier"])
        self.tier_bytes = c.counter(n.KV_OFFLOAD_BYTES, "Block bytes moved to (store) or from "
                                       "(load) a lower tier", ["tier", "direction"])
        self.tier_seconds = c.histogram(n.KV_OFFLOAD_SECONDS, "Seconds of one move of blocks to or "
                                           "from a lower tier", OFFLOAD_BUCKETS, ["tier", "direction"])
        self.tier_evictions = c.counter(n.KV_OFFLOAD_EVICTIONS, "Blocks evicted from a lower tier",
                                           ["tier"])
        self.tier_faults = c.counter(n.KV_OFFLOAD_FAULTS, "Blocks lost to a fault: a bad file "
                                        "(a miss), a failed write, a writer behind", ["tier", "fault"])
        self.expert_load = c.gauge(n.EXPERT_LOAD_IMBALANCE, "A MoE layer's max / mean tokens per expert in a "
                                   "recent forward (1: even)", ["layer"])
        self.tier_blocks = c.gauge(n.KV_OFFLOAD_BLOCKS, "Blocks a lower tier holds", ["tier"])
        self.tier_capacity = c.gauge(n.KV_OFFLOAD_CAPACITY, "Blocks a lower tier holds when full",
                                        ["tier"])
        for tier in lower:
            self.tier_hits.labels(tier)
            self.tier_evictions.labels(tier)
            for direction in ("load", "store"):
                self.tier_bytes.labels(tier, direction)
        for fault in TierFault:
            self.tier_faults.labels("disk", fault)
        self._times: dict[str, RequestTimes] = {}  # req_id -> times (engine thread only)
        self._preemptions_seen = 0

    def set_load(self, load: NodeLoad, preemptions_total: int, heartbeat_failures: int) -> None:
        """Refresh the engine-state gauges (``load``: the published NodeLoad)."""
        for field, gauge in self.load.items():
            gauge.set(getattr(load, field))
        self.preemptions.inc(preemptions_total - self._preemptions_seen)
        self._preemptions_seen = preemptions_total
        self.heartbeat_failures.set(heartbeat_failures)

    # ---- lower tiers (tier_store.TierObserver; engine thread) --------------------------------
    def moved(self, move: Move) -> None:
        tier, direction = move.tier.name.lower(), "load" if move.load else "store"
        self.tier_bytes.labels(tier, direction).inc(move.nbytes)
        self.tier_seconds.labels(tier, direction).observe(move.seconds)

    def looked_up(self, queried_blocks: int, hits: dict[Tier, int]) -> None:
        self.tier_queries.inc(queried_blocks)
        for tier, count in hits.items():
            self.tier_hits.labels(tier.name.lower()).inc(count)

    def evicted(self, tier: Tier, blocks: int) -> None:
        self.tier_evictions.labels(tier.name.lower()).inc(blocks)

    def fault(self, tier: Tier, fault: TierFault) -> None:
        self.tier_faults.labels(tier.name.lower(), fault).inc()

    def set_expert_load(self, per_layer: Sequence[tuple[int, float]]) -> None:
        """A MoE model's expert load imbalance per layer (the engine's published stats)."""
        for layer, ratio in per_layer:
            self.expert_load.labels(str(layer)).set(ratio)

    def set_tiers(self, tiers: Sequence[TierStats]) -> None:
        """The lower tiers' sizes and use (the engine's published stats)."""
        for t in tiers:
            if t.tier is not Tier.DEVICE:
                self.tier_blocks.labels(t.tier.name.lower()).set(t.used_blocks)
                self.tier_capacity.labels(t.tier.name.lower()).set(t.capacity_blocks)

    def set_kv_pool(self, device: str, dtype: str, blocks: int, nbytes: int, tokens: int) -> None:
        """The KV pool's place and size (``NodeRuntime.kv_pool_info``), once at start."""
        self.device_info.labels(device, dtype).set(1)
        for unit, value in (("blocks", blocks), ("bytes", nbytes), ("tokens", tokens)):
            self.kv_pool[unit].set(value)

    def observe_step(self, out: SchedulerOutput, started: float, deltas: list[RequestDelta], live: int) -> None:
        """Engine thread, after a step that began at ``started`` (time.monotonic(), before it
        was scheduled) computed ``out`` (a SchedulerOutput) and produced ``deltas``
        (RequestDeltas); ``live``: the engine's unfinished requests, to bound the timing
        entries. A request's queue interval ends where its first step began, so that step's
        compute counts as its prefill."""
        now = time.monotonic()
        for req, num in out.scheduled:
            prompt = len(req.prompt_token_ids)
            before = req.num_computed_tokens - num  # computed before this step
            t = self._times.get(req.request_id)
            if t is None:
                t = self._times[req.request_id] = RequestTimes(req, started)
                if before < prompt:  # admitted from the queue (not a landed transfer)
                    self.queue_time.observe(max(started - req.arrival_time, 0.0))
                    self.prefix_queries.inc(prompt)
                    self.prefix_hits.inc(max(req.num_cached_tokens, 0))
                else:
                    t.first_token = now
            if t.first_token is None and req.num_computed_tokens >= prompt:
                t.first_token = now
                self.prefill_time.observe(now - t.scheduled)
        for d in deltas:
            if d.finish_reason is not None:
                t = self._times.pop(d.request_id, None)
                # a prefill node's requests end at their first token: no decode interval
                if t is not None and t.first_token is not None and len(t.request.output_token_ids) > 1:
                    self.decode_time.observe(now - t.first_token)
        if len(self._times) > live + PRUNE_SLACK:  # aborted requests get no finishing delta
            for rid, t in list(self._times.items()):
                if t.request.finished:
                    self._times.pop(rid, None)

    def render(self) -> tuple[bytes, str]:
        return self.collectors.render()
