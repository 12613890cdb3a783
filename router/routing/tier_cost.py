"""Prefix hits by tier: a hit's blocks in each tier of a node's prefix cache, and what
loading a block from a lower tier costs next to recomputing it, from the node's
heartbeat (``NodeInfo.tiers``, common/kv_tier_stats.py).

    TierBlocks   a prompt's matched prefix on one node: its blocks by the fastest tier
                 holding each (router/routing/prefix_mirror.py's lookup finds them)
    TierCost     load time over recompute time of one block, for the host and the disk
                 tier of one node (``tier_cost``):

        move(t)      = block_bytes(t) / load_bytes_per_s(t)
        load(host)   = move(host)
        load(disk)   = move(disk) + move(host)   (a disk block is read into host memory and
                       copied on as a host block is: engine/kv/tier_store.py, whose own
                       choice to load or recompute adds the two the same way)
        recompute    = block_bytes(device) / load_bytes_per_s(device)   (the device tier's
                       load rate is the node's prefill rate, in bytes of blocks per second)
        ratio(t)     = load(t) / recompute: 0 costs nothing, 1 as much as recomputing,
                       above 1 more (a tier slower than the node's prefill); a disk
                       block's never below a host block's

A rate a node does not report (no tiers in its heartbeat: a node from before tiers or
without lower tiers; 0.0: nothing measured yet) is the default of its kind below, so
with nothing measured a host hit costs RECOMPUTE / HOST ~ 0.09 and a disk hit
RECOMPUTE / DISK + RECOMPUTE / HOST ~ 0.95 of recomputing it. A device hit is priced
as the router always priced a hit (``CacheAwareWeights.cached_token``);
router/routing/cache_aware.py weighs a lower-tier hit as that device hit plus ratio(t) x the
work recomputing its blocks would be, so it is never cheaper than the same hit on the
device. A ratio above 1 prices the hit above recomputing, so the router prefers a
node without it: such a node recomputes those blocks instead of loading them (the
engine loads only when that pays) and reports fewer cached tokens than predicted.

Owns the defaults, the ratios and the hit's split. Must not weigh them against load
(router/routing/cache_aware.py does) or do I/O.
"""

from __future__ import annotations

from typing import NamedTuple

from ...common.kv_events import TIER_NAMES, Tier
from ...common.kv_tier_stats import TierStats
from ...common.node_registry import NodeInfo

# Where a node reports no rate of its own (bytes of KV per second):
# host memory -> an H100 over PCIe Gen5 x16 (64 GB/s a direction, ~50 achieved from pinned memory)
HOST_LOAD_BYTES_PER_S = 50e9
# disk -> device: one NVMe drive's sequential read (Gen4 ~7 GB/s, Gen5 ~12 GB/s peak; ~5 sustained
# through the page cache and a bounce through host memory)
DISK_LOAD_BYTES_PER_S = 5e9
# recompute: the llama3-8b-h100 simulated profile (common/sim_profiles.toml) prefills a
# 4096-token prompt at ~33,000 tokens/s x 128 KiB of KV per token ~ 4.3 GB/s of blocks
RECOMPUTE_BYTES_PER_S = 4.3e9


class TierBlocks(NamedTuple):
    """The blocks of a prompt's matched prefix on one node, by the fastest tier holding
    each (fields named and ordered as `Tier`)."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk

    @property
    def lower(self) -> int:
        """Blocks held only below the device."""
        return self.host + self.disk

    def by_tier(self) -> dict[str, int]:
        """{"device": n, "host": m, "disk": k} (/debug/decisions)."""
        return dict(zip(self._fields, self))


assert TierBlocks._fields == TIER_NAMES, "TierBlocks must name every Tier"



class TierCost(NamedTuple):
    """Load time of one block over its recompute time, per lower tier of one node."""

    host: float
    disk: float

    def of(self, split: TierBlocks) -> float:
        """The mean ratio of ``split``'s lower-tier blocks (0.0: none)."""
        lower = split.lower
        return (split.host * self.host + split.disk * self.disk) / lower if lower else 0.0


def tier_cost(node: NodeInfo) -> TierCost:
    """``node``'s ratios from its heartbeat's tiers, the defaults where it reports none."""
    by_tier = {s.tier: s for s in node.tiers}
    block = next((s.block_bytes for s in node.tiers if s.block_bytes > 0), 1)  # cancels when unknown
    recompute = _block_s(by_tier.get(Tier.DEVICE), block, RECOMPUTE_BYTES_PER_S)
    host = _block_s(by_tier.get(Tier.HOST), block, HOST_LOAD_BYTES_PER_S)
    disk = _block_s(by_tier.get(Tier.DISK), block, DISK_LOAD_BYTES_PER_S) + host
    return TierCost(host / recompute, disk / recompute)


def _block_s(stats: TierStats | None, block_bytes: int, default_rate: float) -> float:
    """Seconds to move one block out of a tier at its measured load rate (the default
    where it has none)."""
    if stats is None:
        return block_bytes / default_rate
    rate = stats.load_bytes_per_s if stats.load_bytes_per_s > 0 else default_rate
    return (stats.block_bytes if stats.block_bytes > 0 else block_bytes) / rate
