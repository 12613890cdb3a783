"""Wire types of the prefix-cache event stream a node publishes (the Redis index
consumes it) and of the index updates routers mirror it from.

Owns: the event structs, ``IndexUpdate`` (a node's folded batch tagged with its id,
epoch and sequence number) and their msgpack encoding. Must not: know about Redis
keys or channels, or import torch.

Semantics, in stream order:

- ``BlockStored``: blocks with these hashes now hold KV on this node.
  ``block_hashes`` form one chain: ``parent_hash`` is the parent of
  ``block_hashes[0]`` (None: a root block) and each later hash is the child of the
  one before. ``token_ids`` are the blocks' tokens, concatenated
  (``len(token_ids) == len(block_hashes) * block_size``).
- ``BlockRemoved``: these hashes are no longer held (evicted).
- ``AllBlocksCleared``: nothing is held any more (prefix cache reset).
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    """A chain of full blocks registered in the prefix cache."""

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]
    block_size: int

    def __post_init__(self) -> None:
        # Runs on construction and on decode (a violation is a ValidationError).
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(
                f"token_ids has {len(self.token_ids)} ids, expected "
                f"{len(self.block_hashes)} blocks x {self.block_size}"
            )


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    """Blocks evicted from the prefix cache."""

    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, tag=True, omit_defaults=True):
    """Events drained from one node at wall-clock time ``ts`` (seconds since epoch)."""

    ts: float
    events: list[KVEvent]


def encode_event_batch(batch: EventBatch) -> bytes:
    """msgpack bytes of ``batch``."""
    return msgspec.msgpack.encode(batch)


def decode_event_batch(data: bytes) -> EventBatch:
    """Inverse of ``encode_event_batch``; raises msgspec.ValidationError on bad input."""
    return msgspec.msgpack.decode(data, type=EventBatch)


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


def encode_index_update(update: IndexUpdate) -> bytes:
    return msgspec.msgpack.encode(update)


def decode_index_update(data: bytes) -> IndexUpdate:
    """Inverse of ``encode_index_update``; raises msgspec.ValidationError on bad input."""
    return msgspec.msgpack.decode(data, type=IndexUpdate)
