"""NodeLoad: how loaded one engine is, the one type for it everywhere. The engine
computes it after every pass (engine/engine_core.py), the event loop reads the
published copy (adding the prefix pulls it serves, node/runtime.py ``load``), the heartbeat
carries it in the node registry record, and routers score nodes with it."""

import msgspec


class NodeLoad(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True, frozen=True):
    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests admitted but not yet running
    queued_prefill_tokens: int = 0  # prompt tokens admitted and not yet computed
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    kv_free_blocks: int = 0
    generated_tokens: int = 0  # output tokens the running requests have produced so far
    # Prefix pulls (node/pull_budget.py): those it serves now, and the rate it copies blocks out
    # for them, all together, in bytes per second (a busy node's share of its steps; 0.0: not
    # measured). The router prices a pull from it with both (router/routing/pull_cost.py).
    pulls_serving: int = 0
    pull_bytes_per_s: float = 0.0
