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
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from .base import KVSender
from .block_store import KVBlockStore
from .layout import KVShard
from .tp_plan import RankSend, transfer_plan


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

    async def send(self, addrs: Sequence[str], transfer_id: str, src_ids: Sequence[int],
                   dest_ids: Sequence[int]) -> int:
        """Send this rank's heads of blocks ``src_ids`` (its cache) into ``dest_ids`` of the
        decode ranks at ``addrs`` (one per decode rank, in rank order); the bytes sent.
        Raises ``TransferError`` (the first failure, once every send settled)."""
        assert len(src_ids) == len(dest_ids), f"{len(src_ids)} source blocks for {len(dest_ids)} destinations"
        sends = self.sends(len(addrs))
        if not src_ids or not sends:
            return 0

        async def one(s: RankSend) -> int:
            local = s.part.prefill_local
            items = self.store.split(self.store.pack(src_ids, heads=local), heads=local)
            await self.sender.send_blocks(addrs[s.decode_rank], transfer_id, list(zip(dest_ids, items)),
                                          heads=s.part.heads)
            return len(items) * self.store.slice_layout(local).block_nbytes

        results = await asyncio.gather(*(one(s) for s in sends), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return sum(r for r in results if isinstance(r, int))
