"""Outcomes: how a unit of work ended, one enum per kind, defined once.

Code decides an outcome as one of these values and carries it to the metrics, where
it becomes the label (a StrEnum is its own label string); every value of each enum is
exported at 0 from the start, so rate() and alerts see a counter before its first
event. Owns no collectors (node/metrics.py and router/metrics.py do).
"""

from enum import StrEnum


# ---- nodes -------------------------------------------------------------------------------------
class PrefillOutcome(StrEnum):
    """One /prefill call on a prefill node."""
    OK = "ok"
    BAD_REQUEST = "bad_request"
    REFUSED = "refused"  # could not start now (queue, KV cache, draining): 503
    ABORTED = "aborted"
    ERROR = "error"  # the engine failed it
    TRANSFER_FAILED = "transfer_failed"


class TransferEnd(StrEnum):
    """How a KV transfer ended on the decode node."""
    OWNED = "owned"  # every block landed; the request runs on them
    FAILED = "failed"
    ABORTED = "aborted"  # the request was cancelled while it ran


class TransferStage(StrEnum):
    """A stage of a request's path through a decode node that a prefill node serves."""
    RESERVE = "reserve"  # asked -> blocks reserved (the engine thread's queue and the lookup)
    TRANSFER = "transfer"  # reserved -> every block and the first token in (the prefill node's work)
    ADMIT = "admit"  # -> admitted into the running batch, the first token out


class TierFault(StrEnum):
    """Why a block did not make it to or back from a lower tier of the prefix cache."""
    CORRUPT = "corrupt"  # a disk file failed a check when read (cut short, wrong sizes, layout): deleted, a miss
    UNAUTHENTICATED = "unauthenticated"  # its MAC did not verify (planted, another key's, damaged): deleted, a miss
    UNSAFE = "unsafe"  # not a regular file of this node's user (a symlink, folder, fifo, another's): dropped, a miss
    WRITE_FAILED = "write_failed"  # the write raised (disk full, permissions): the block is dropped
    QUEUE_FULL = "queue_full"  # the disk writer is behind: the block is dropped, not waited for


class FallbackReason(StrEnum):
    """Why a decode node prefilled a request itself instead of receiving its KV."""
    NO_BLOCKS = "no_blocks"  # the KV cache had too few free blocks to reserve for the prompt
    TRANSFER_FAILED = "transfer_failed"  # refused, failed or timed out (the detail is logged)


class PrefixReuse(StrEnum):
    """Where a routing decision expects the prompt's cached prefix to come from."""
    NONE = "none"  # computed in full
    OWN = "own"  # the computing node's own prefix cache (a decode node prefilling itself included)
    PULL = "pull"  # pulled from another node first (node/kv_pull.py)


class PullOutcome(StrEnum):
    """How one prefix pull ended on the node that asked for it (node/kv_pull.py)."""
    PULLED = "pulled"  # every block the holder sent landed; they are this node's cached prefix now
    HELD_NONE = "held_none"  # the holder no longer holds the prefix's next block (evicted): nothing moved
    NO_BLOCKS = "no_blocks"  # this node's pool could not hold the prefix now
    FAILED = "failed"  # the holder was unreachable, refused, died, a block failed its checksum, or the lease expired
    ABORTED = "aborted"  # the request was cancelled mid-pull


class PullServed(StrEnum):
    """How one pull asked of this node (the holder) ended."""
    SENT = "sent"  # its leading held blocks were sent and acknowledged (possibly none)
    FAILED = "failed"  # the send failed (the puller recomputes)
    REFUSED = "refused"  # it served PULLS_SERVED_MAX pulls already: 503 (node/pull_budget.py)
    ABORTED = "aborted"  # the puller hung up (cancelled, or died) before it was sent


class PromptHashResult(StrEnum):
    """What a node did with the block hashes the router carried (common/protocol.py
    PromptHashes)."""
    ADOPTED = "adopted"
    REHASHED = "rehashed"  # they did not check out: the engine hashed the prompt
    ABSENT = "absent"  # none carried


class GrammarCompileOutcome(StrEnum):
    """One structured-output grammar a node needed (node/grammar_service.py)."""
    CACHED = "cached"  # compiled before: no work
    COMPILED = "compiled"  # compiled now, in a worker process
    INVALID = "invalid"  # xgrammar refused it (a bad schema, regex or grammar): 400
    TIMEOUT = "timeout"  # over the compile CPU-time limit, the worker killed: 400 (too complex)
    TOO_LARGE = "too_large"  # compiled, but too large to keep: 400
    REFUSED = "refused"  # refused before (one of the three above), answered from memory: 400
    BUSY = "busy"  # too many compiles already waiting for a worker: 503
    STARVED = "starved"  # no answer in WALL_FACTOR x the limit (a CPU too busy to run it): 503
    CRASHED = "crashed"  # the worker died otherwise: 503
    LATE = "late"  # not compiled within the node's wait (node/grammar_service.py); it compiles on: 503
    UNCOMPILED = "uncompiled"  # not held, and the request may not compile it (compile_grammar false): 409


class IndexBatchResult(StrEnum):
    """One write of prefix-cache events to the Redis index."""
    OK = "ok"
    REFUSED = "refused"  # Redis lost earlier batches: a snapshot follows
    ERROR = "error"  # Redis unreachable


# ---- router ------------------------------------------------------------------------------------
class FailureReason(StrEnum):
    """Why a routed request ended without a finish reason."""
    NODE_ERROR = "node_error"
    NODE_UNAVAILABLE = "node_unavailable"
    CLIENT_DISCONNECT = "client_disconnect"
    CANCELLED = "cancelled"


class IndexLookupResult(StrEnum):
    OK = "ok"
    ERROR = "error"
    SKIPPED = "skipped"


class PredictionOutcome(StrEnum):
    """A routing decision's predicted prefix hit against what the node delivered."""
    HIT = "hit"  # delivered at least what was predicted
    MISS = "miss"  # delivered less than predicted
    UNSEEN = "unseen"  # nothing predicted, something delivered
    NONE = "none"  # nothing predicted, nothing delivered
    FAILED = "failed"  # the request failed: nothing to compare (in /debug/decisions, never counted)


class StoreResult(StrEnum):
    """What became of a /v1/responses entry the router meant to store (router/responses/store.py)."""
    STORED = "stored"
    TOO_LARGE = "too_large"  # one entry over the entry limit: not stored, the request succeeds
    KEY_FULL = "key_full"  # its key's quota (bytes or entries) is used up: 429
    OVER_SHARE = "over_share"  # the store's budget is full and its key holds more than its share: 429
    STORE_FULL = "store_full"  # the store's budget is full, its key within its share: 503
    UNAVAILABLE = "unavailable"  # Redis failed: not stored (logged), the request succeeds


# ---- planner -----------------------------------------------------------------------------------
class ScrapeFailure(StrEnum):
    """Why the planner could not read a router's /metrics (deploy/planner/observe.py)."""
    UNAUTHORIZED = "unauthorized"  # 401 / 403: --protect-metrics, and the planner lacks the cluster token
    BAD_STATUS = "bad_status"  # any other answer than 200
    UNREACHABLE = "unreachable"  # no answer: connection refused, timed out, reset
