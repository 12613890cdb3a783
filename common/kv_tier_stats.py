"""What a node reports of each tier of its prefix cache (its heartbeat: ``NodeInfo.tiers``):
size, use and the measured move rates the router prices a hit in that tier with.

Filled by the node from its engine's lower tiers (engine/kv/tier_store.py) and, for the
device tier, from its KV pool. Must not import torch or node code.
"""

from __future__ import annotations

import msgspec

from .kv_events import Tier


class TierStats(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """One tier of one node's prefix cache."""
    tier: Tier
    capacity_blocks: int  # blocks the tier holds when full
    used_blocks: int  # blocks it holds now
    block_bytes: int  # bytes of one block (all layers, K and V, every rank's heads)
    # Measured on this node (0.0: nothing measured yet): bytes per second moved into the
    # device cache from this tier (a load) and out of the tier above into it (a store). The
    # device tier's load rate is the node's prefill rate in blocks' worth of bytes: what
    # recomputing a block costs.
    load_bytes_per_s: float = 0.0
    store_bytes_per_s: float = 0.0
