"""The prefix-cache events of one engine, and the index updates routers mirror.

Events (in-process: engine thread -> the node's event loop -> node/kv_publisher.py,
which folds them into Redis writes), in stream order:

- ``BlockStored``: blocks with these hashes now hold KV on this node, in ``tier`` (the
  fastest tier that holds each: device memory, else host memory, else disk); the hashes
  form one chain (each the child of the one before) when stored on the device. A hash
  stored again with another tier moved there (evicted from the device into host memory,
  loaded back from disk, ...).
- ``BlockRemoved``: these hashes are no longer held in any tier.
- ``AllBlocksCleared``: nothing is held any more (prefix cache reset).

``IndexUpdate`` is a wire type (msgpack on Redis pub/sub): a node's folded batch
tagged with its id, epoch and sequence number. Must not: know about Redis keys or
pub/sub channels, or import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import msgspec


class Tier(IntEnum):
    """Where a node holds a block's KV, fastest first (engine/kv/tier_store.py: the lower tiers)."""
    DEVICE = 0  # the engine's KV cache (GPU memory, or this process's memory on the CPU)
    HOST = 1  # the host-memory pool (--kv-offload-memory; pinned on CUDA)
    DISK = 2  # files under --kv-offload-dir


TIER_NAMES = tuple(t.name.lower() for t in Tier)  # the label values of a tier in metrics and JSON


@dataclass(slots=True)
class BlockStored:
    """Full blocks registered in the prefix cache (the engine appends to the last event
    while the chain continues), or moved to ``tier``."""
    block_hashes: list[int]
    tier: Tier = Tier.DEVICE


@dataclass(slots=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache (the engine appends while evictions follow)."""
    block_hashes: list[int]


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class IndexUpdate(msgspec.Struct, tag=True, omit_defaults=True):
    """One applied index write of (node_id, epoch), published on ``EVENTS_CHANNEL``
    (common/kv_index.py) atomically with the write: batch ``seq`` of the node's
    folded events. ``clear``: a full write, the stored lists are then everything the
    node holds (a resync point); otherwise ``removed`` then the stored lists apply on
    top of batch ``seq - 1``. Routers mirror the index from these.

    A stored hash is in exactly one list, by the fastest tier that holds it now:
    ``stored`` (the device), ``stored_host``, ``stored_disk``; a hash already held
    that appears in another list moved there. An update without the tier lists (a
    node from before tiers, or one without lower tiers) holds everything on the
    device, and a reader from before tiers still reads ``stored`` and ``removed``."""

    node_id: str
    epoch: str
    seq: int
    clear: bool = False
    stored: list[int] = []
    removed: list[int] = []
    stored_host: list[int] = []
    stored_disk: list[int] = []
