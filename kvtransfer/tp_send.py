"""One prefill rank's part of a tensor-parallel transfer: pack, for each decode rank the
plan gives this rank, the slice of the blocks holding that rank's heads, and send it.

Owns ``ShardSender`` (a rank's ``KVSender`` and ``KVBlockStore`` run through
``tp_plan.transfer_plan``). Must not: decide the plan (``tp_plan.py``), know how the
decode ranks' addresses were learned (the node's ``PrefillRequest`` carries them, one per
decode rank, in rank order), or import the model.

Every prefill rank of a node runs ``send`` for the same transfer with the same arguments;
together they move each decode rank exactly its heads::

    prefill rank r:  for (decode rank s, part) in plan.sends_of(r):       (concurrently)
                         pack(src blocks, heads=part.prefill_local)      one gather of the slice
                         send_blocks(addrs[s], transfer, ..., heads=part.heads)

A node packs where the blocks are known intact (its engine thread, or a worker between two
steps) and sends later, from its event loop: ``pack`` then ``send_packed``, which is what
``send`` does in one go.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import NamedTuple

from .base import KVSender
from .block_store import KVBlockStore
from .layout import KVShard
from .tp_plan import RankSend, transfer_plan


class PackedSend(NamedTuple):
    """One slice this rank sends: the plan's ``send`` and the packed blocks holding it."""

    send: RankSend
    items: list  # per-block items of the slice (KVBlockStore.split), in source order
    nbytes: int  # bytes of the slice, all blocks


def pack_sends(store: KVBlockStore, shard: KVShard, decode_tp: int, src_ids: Sequence[int]) -> list[PackedSend]:
    """Rank ``shard``'s slices of blocks ``src_ids`` (of ``store``, its cache) for a
    ``decode_tp``-rank node, packed: one gather each into fresh buffers, so the blocks may
    be reused once this returns (a node packs on the thread that steps, and sends later).
    Empty for an idle replica. Raises ``ValueError`` when no plan exists."""
    plan = transfer_plan(shard.compat.tp, decode_tp, shard.compat.num_kv_heads)
    out = []
    for s in plan.sends_of(shard.rank):
        local = s.part.prefill_local
        items = store.split(store.pack(src_ids, heads=local), heads=local) if src_ids else []
        out.append(PackedSend(s, items, len(items) * store.slice_layout(local).block_nbytes))
    return out


class ShardSender:
    """Sends this rank's share of transfers. ``sender`` and ``store`` are this rank's
    (the store over its shard of the cache, the sender made with ``shard``)."""

    def __init__(self, sender: KVSender, store: KVBlockStore, shard: KVShard):
        assert store.layout == shard.layout, f"store {store.layout} is not the cache of {shard.describe()}"
        self.sender = sender
        self.store = store
        self.shard = shard

    def sends(self, decode_tp: int) -> list[RankSend]:
        """What this rank sends to a ``decode_tp``-rank node (empty for an idle replica).
        Raises ``ValueError`` when no plan exists (the handshake would refuse it too)."""
        plan = transfer_plan(self.shard.compat.tp, decode_tp, self.shard.compat.num_kv_heads)
        return plan.sends_of(self.shard.rank)

    def pack(self, decode_tp: int, src_ids: Sequence[int]) -> list[PackedSend]:
        """``pack_sends`` of this rank's store."""
        return pack_sends(self.store, self.shard, decode_tp, src_ids)

    async def send_packed(self, addrs: Sequence[str], transfer_id: str, packed: Sequence[PackedSend],
                          dest_ids: Sequence[int]) -> int:
        """Send ``pack``'s slices into ``dest_ids`` of the decode ranks at ``addrs`` (one per
        decode rank, in rank order), concurrently; the bytes sent. Raises ``TransferError``
        (the first failure, once every send settled)."""

        async def one(p: PackedSend) -> int:
            assert len(p.items) == len(dest_ids), f"{len(p.items)} packed blocks for {len(dest_ids)} destinations"
            await self.sender.send_blocks(addrs[p.send.decode_rank], transfer_id, list(zip(dest_ids, p.items)),
                                          heads=p.send.part.heads)
            return p.nbytes

        results = await asyncio.gather(*(one(p) for p in packed if p.items), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return sum(r for r in results if isinstance(r, int))

    async def send(self, addrs: Sequence[str], transfer_id: str, src_ids: Sequence[int],
                   dest_ids: Sequence[int]) -> int:
        """Send this rank's heads of blocks ``src_ids`` (its cache) into ``dest_ids`` of the
        decode ranks at ``addrs`` (one per decode rank, in rank order); the bytes sent.
        Raises ``TransferError`` (the first failure, once every send settled)."""
        assert len(src_ids) == len(dest_ids), f"{len(src_ids)} source blocks for {len(dest_ids)} destinations"
        return await self.send_packed(addrs, transfer_id, self.pack(len(addrs), src_ids), dest_ids)
