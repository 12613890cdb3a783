"""Every Prometheus metric name splitserve exports, defined once.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` -> ``splitserve:time_to_first_token_seconds``):
the same suffixes and label names, so dashboards and alerts written for vLLM work with the
prefix changed. Every series carries ``model_name`` (the served model name). Node series also
carry ``role`` (prefill | decode | colocated), so one query can split by role. The
disaggregation-specific metrics (KV transfers, fallbacks, routing decisions, predicted versus
delivered prefix hits) keep their own names alongside.

Each constant is the name as scraped: counters end in ``_total`` (prometheus_client adds the
suffix when given a name without it, and strips it when given one with it). Histograms expose
``<name>_bucket``, ``<name>_sum`` and ``<name>_count``.

Owns names and label names only; must not create collectors (router/metrics.py and
node/metrics.py do) or import torch.
"""

PREFIX = "splitserve:"
MODEL_LABEL = "model_name"  # on every series
ROLE_LABEL = "role"  # on every node series: the node's role

# ---- request latencies and tokens (router: what the client sees; vLLM's frontend names) ----
TIME_TO_FIRST_TOKEN = PREFIX + "time_to_first_token_seconds"  # histogram
INTER_TOKEN_LATENCY = PREFIX + "inter_token_latency_seconds"  # histogram, one sample per token gap
TIME_PER_OUTPUT_TOKEN = PREFIX + "request_time_per_output_token_seconds"  # histogram, per request
E2E_REQUEST_LATENCY = PREFIX + "e2e_request_latency_seconds"  # histogram
REQUEST_PROMPT_TOKENS = PREFIX + "request_prompt_tokens"  # histogram
REQUEST_GENERATION_TOKENS = PREFIX + "request_generation_tokens"  # histogram
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"  # counter
GENERATION_TOKENS = PREFIX + "generation_tokens_total"  # counter
REQUEST_SUCCESS = PREFIX + "request_success_total"  # counter, label finished_reason
FINISHED_REASON_LABEL = "finished_reason"

# ---- router only -----------------------------------------------------------------------------
HTTP_REQUESTS = PREFIX + "router_http_requests_total"  # counter, labels endpoint, status
REQUEST_FAILURES = PREFIX + "request_failures_total"  # counter, label reason
REQUEST_MIGRATIONS = PREFIX + "request_migrations_total"  # counter: generations moved to another decode node
ROUTER_RUNNING = PREFIX + "router_requests_running"  # gauge: generations streaming now
ROUTER_INFLIGHT_REQUESTS = PREFIX + "router_inflight_requests"  # gauge: generating HTTP requests admitted
ADMISSION_REJECTIONS = PREFIX + "router_admission_rejections_total"  # counter, label reason
ROUTER_NODES = PREFIX + "router_nodes"  # gauge, label role: live nodes of the model
ROUTING_DECISIONS = PREFIX + "routing_decisions_total"  # counter, labels node_id, role
LOCAL_PREFILL_DECISIONS = PREFIX + "local_prefill_decisions_total"  # counter
ROUTING_DECISION_SECONDS = PREFIX + "routing_decision_seconds"  # histogram
ROUTER_EVENT_LOOP_LAG = PREFIX + "router_event_loop_lag_seconds"  # histogram: timer wake-up delay
REDIS_ERRORS = PREFIX + "redis_errors_total"  # counter, label op
PREFIX_INDEX_LOOKUPS = PREFIX + "prefix_index_lookups_total"  # counter, label result
RESPONSES_STORED = PREFIX + "responses_stored_total"  # counter, label result (common/outcomes.py StoreResult)
# Predicted versus delivered prefix-cache hits of the routing decisions, in prompt tokens.
PREDICTED_CACHED_TOKENS = PREFIX + "routing_predicted_cached_tokens_total"  # counter, label tier: device | host | disk
DELIVERED_CACHED_TOKENS = PREFIX + "routing_delivered_cached_tokens_total"  # counter
PREFIX_PREDICTIONS = PREFIX + "prefix_predictions_total"  # counter, label outcome
PREFIX_PREDICTION_HIT_RATE = PREFIX + "prefix_prediction_hit_rate"  # gauge

# ---- nodes: engine state (vLLM's engine names) -------------------------------------------------
NUM_REQUESTS_RUNNING = PREFIX + "num_requests_running"  # gauge
NUM_REQUESTS_WAITING = PREFIX + "num_requests_waiting"  # gauge
NUM_QUEUED_PREFILL_TOKENS = PREFIX + "num_queued_prefill_tokens"  # gauge: prompt tokens still to compute
KV_CACHE_USAGE = PREFIX + "kv_cache_usage_perc"  # gauge, 0..1 (vLLM's name and range)
KV_FREE_BLOCKS = PREFIX + "kv_cache_free_blocks"  # gauge
NUM_RUNNING_GENERATED_TOKENS = PREFIX + "num_running_generated_tokens"  # gauge: output tokens of the running batch so far
NODE_DEVICE_INFO = PREFIX + "node_device_info"  # gauge = 1, labels device, dtype
KV_POOL_BLOCKS = PREFIX + "kv_pool_blocks"  # gauge: the KV cache's size (the metric keeps the older word "pool")
KV_POOL_BYTES = PREFIX + "kv_pool_bytes"  # gauge
KV_POOL_TOKENS = PREFIX + "kv_pool_tokens"  # gauge
PREFIX_CACHE_QUERIES = PREFIX + "prefix_cache_queries_total"  # counter, prompt tokens looked up
PREFIX_CACHE_HITS = PREFIX + "prefix_cache_hits_total"  # counter, prompt tokens found cached
NUM_PREEMPTIONS = PREFIX + "num_preemptions_total"  # counter
# gauge, label layer: a MoE model's max / mean tokens per expert in a recent forward (1: even; experts: all on one)
EXPERT_LOAD_IMBALANCE = PREFIX + "expert_load_imbalance"
# Lower tiers of the prefix cache (engine/kv/tier_store.py), label tier (host, disk), in blocks
# (vLLM's offloading connector and LMCache count the same things):
KV_OFFLOAD_QUERIES = PREFIX + "kv_offload_queries_total"  # counter: prompt blocks looked up below the device
KV_OFFLOAD_HITS = PREFIX + "kv_offload_hits_total"  # counter, label tier: blocks found (and loaded)
KV_OFFLOAD_BYTES = PREFIX + "kv_offload_bytes_total"  # counter, labels tier, direction (load, store)
KV_OFFLOAD_SECONDS = PREFIX + "kv_offload_seconds"  # histogram, labels tier, direction: one move
KV_OFFLOAD_EVICTIONS = PREFIX + "kv_offload_evictions_total"  # counter, label tier: blocks evicted
KV_OFFLOAD_FAULTS = PREFIX + "kv_offload_faults_total"  # counter, labels tier, fault: misses by bad file, ...
KV_OFFLOAD_BLOCKS = PREFIX + "kv_offload_blocks"  # gauge, label tier: blocks held
KV_OFFLOAD_CAPACITY = PREFIX + "kv_offload_capacity_blocks"  # gauge, label tier: blocks it holds when full
REQUEST_QUEUE_TIME = PREFIX + "request_queue_time_seconds"  # histogram: added -> first scheduled
REQUEST_PREFILL_TIME = PREFIX + "request_prefill_time_seconds"  # histogram: first scheduled -> prompt done
REQUEST_DECODE_TIME = PREFIX + "request_decode_time_seconds"  # histogram: first token -> finished
HEARTBEAT_FAILURES = PREFIX + "node_heartbeat_failures"  # gauge: consecutive failed node registry writes

# ---- nodes: disaggregation ---------------------------------------------------------------------
PREFILL_REQUESTS = PREFIX + "prefill_requests_total"  # counter, label outcome (prefill node)
KV_BLOCKS_SENT = PREFIX + "kv_blocks_sent_total"  # counter (prefill node)
KV_BYTES_SENT = PREFIX + "kv_bytes_sent_total"  # counter (prefill node): block bytes acknowledged
# counter (prefill node): seconds spent in sends, first frame out to last ack; bytes / seconds
# is the transport's rate while it runs (the gaps while chunks compute left out)
KV_SEND_SECONDS = PREFIX + "kv_send_seconds_total"
KV_BLOCKS_RECEIVED = PREFIX + "kv_blocks_received_total"  # counter, label ok (decode node)
KV_TRANSFERS = PREFIX + "kv_transfers_total"  # counter, label state: owned | failed | aborted
KV_TRANSFER_STAGE_SECONDS = PREFIX + "kv_transfer_stage_seconds"  # histogram (decode node), label stage
FALLBACK_PREFILLS = PREFIX + "decode_fallback_prefills_total"  # counter, label reason
KV_PULLS = PREFIX + "kv_pulls_total"  # counter, label outcome (the node that pulled)
KV_PULL_TOKENS = PREFIX + "kv_pull_tokens_total"  # counter: prompt tokens landed by pulls (the node that pulled)
KV_PULLS_SERVED = PREFIX + "kv_pulls_served_total"  # counter, label outcome (the holder)
KV_PULL_BLOCKS_SERVED = PREFIX + "kv_pull_blocks_served_total"  # counter: blocks sent to pullers (the holder)
# The holder's pull budget (node/pull_budget.py): the pulls it serves now (gauge), the rate it copies
# blocks out for them, all together (gauge, bytes/s: a busy holder's share of its steps), the bytes it
# holds packed for them (gauge, at most --kv-pull-memory), and the seconds its engine spent copying
# blocks out for them, lower-tier loads included (counter; over a window, / the window's wall time is
# the share of the holder's time its pulls took)
KV_PULLS_SERVING = PREFIX + "kv_pulls_serving"
KV_PULL_COPY_RATE = PREFIX + "kv_pull_copy_bytes_per_second"
KV_PULL_PACKED_BYTES = PREFIX + "kv_pull_packed_bytes"
KV_PULL_COPY_SECONDS = PREFIX + "kv_pull_copy_seconds_total"
KV_INDEX_BATCHES = PREFIX + "kv_index_batches_total"  # counter, label result
PROMPT_HASHES = PREFIX + "prompt_hashes_total"  # counter, label result: adopted | rehashed | absent
GRAMMAR_COMPILES = PREFIX + "grammar_compiles_total"  # counter, label outcome (common/outcomes.py GrammarCompileOutcome)
GRAMMAR_COMPILE_SECONDS = PREFIX + "grammar_compile_seconds"  # histogram: one worker compile, wall seconds

# ---- the planner (deploy/planner/: `splitserve planner`, `up --planner`) ---------------------------
# Gauges labelled role (prefill | decode) unless said otherwise. On Kubernetes the HPAs follow
# PLANNER_TARGET_REPLICAS through the Prometheus adapter (deploy/k8s/components/planner).
PLANNER_TARGET_REPLICAS = PREFIX + "planner_target_replicas"  # gauge: the bounded size it wants
PLANNER_CURRENT_REPLICAS = PREFIX + "planner_current_replicas"  # gauge: nodes serving or starting
PLANNER_OBSERVED_LOAD = PREFIX + "planner_observed_load"  # gauge, label series: rate | isl | osl
PLANNER_PREDICTED_LOAD = PREFIX + "planner_predicted_load"  # gauge, label series
# gauge, labels series, predictor: mean absolute percentage error of its forecasts so far
PLANNER_PREDICTION_ERROR = PREFIX + "planner_prediction_error"
PLANNER_CORRECTION = PREFIX + "planner_correction"  # gauge: observed / profile time of the role
PLANNER_SLO_MARGIN = PREFIX + "planner_slo_margin"  # gauge: (bound - predicted) / bound at the target
PLANNER_OBSERVED_WITHIN_SLO = PREFIX + "planner_observed_within_slo"  # gauge, label slo: ttft | itl
PLANNER_DECISIONS = PREFIX + "planner_decisions_total"  # counter, labels role, action: up | down | hold
PLANNER_NODES_CHANGED = PREFIX + "planner_nodes_changed_total"  # counter, labels role, action: started | drained
PLANNER_ACTIONS = ("up", "down", "hold")
PLANNER_SERIES = ("rate", "isl", "osl")
# counter, label reason (common/outcomes.py ScrapeFailure): a router's /metrics the planner could not read
PLANNER_SCRAPE_FAILURES = PREFIX + "planner_scrape_failures_total"
PLANNER_ROUTERS_SCRAPED = PREFIX + "planner_routers_scraped"  # gauge: routers whose /metrics the last scrape read

# ---- label values known in advance that are not outcomes (those are common/outcomes.py's
# enums): every series starts at 0, so rate() and the alerts see a counter before its first
# event (callers may still add values).
FINISHED_REASONS = ("stop", "length", "abort")
REDIS_OPS = ("list_nodes", "index_lookup")
# router/http/admission.py, listener.py, compile_budget.py
ADMISSION_REJECTION_REASONS = ("busy", "draining", "connections", "schema_compiles")
BLOCK_OK = ("true", "false")
