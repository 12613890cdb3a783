"""The prefix-cache events of one engine, and the index updates routers mirror.

Events (in-process: engine thread -> the node's event loop -> node/kv_publisher.py,
which folds them into Redis writes), in stream order:

- ``BlockStored``: blocks with these hashes now hold KV on this node; the hashes
  form one chain (each the child of the one before).
- ``BlockRemoved``: these hashes are no longer held (evicted).
- ``AllBlocksCleared``: nothing is held any more (prefix cache reset).

``IndexUpdate`` is a wire type (msgpack on Redis pub/sub): a node's folded batch
tagged with its id, epoch and sequence number. Must not: know about Redis keys or
channels, or import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass(slots=True)
class BlockStored:
    """A chain of full blocks registered in the prefix cache (the engine appends to the
    last event while the chain continues)."""
    block_hashes: list[int]


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
    folded events. ``clear``: a full write, ``stored`` is then everything the node
    holds (a resync point); otherwise ``removed`` then ``stored`` apply on top of
    batch ``seq - 1``. Routers mirror the index from these."""

    node_id: str
    epoch: str
    seq: int
    clear: bool = False
    stored: list[int] = []
    removed: list[int] = []
