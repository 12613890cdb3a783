"""NodeLoad: how loaded one engine is, the one type for it everywhere. The engine
computes it after every pass (engine/engine_core.py), the event loop reads the
published copy, the heartbeat carries it in the registry record, and routers score
nodes with it."""

import msgspec


class NodeLoad(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True, frozen=True):
    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests admitted but not yet running
    queued_prefill_tokens: int = 0  # prompt tokens admitted and not yet computed
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    kv_free_blocks: int = 0
    generated_tokens: int = 0  # output tokens the running requests have produced so far
