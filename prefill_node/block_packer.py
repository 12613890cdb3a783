"""Rank 0's pack of a prefill node's block exports: the ``pack`` of its BlockExporter
(engine/block_export.py), run on the engine thread right after the step that completed
the blocks.

Owns ``BlockPacker`` and the ``PackedChunk`` it makes. Must not hold anything the event
loop writes: a request's export comes whole in its ``ExportKV``, and the packer reads only
facts fixed when the node started (the KV store, rank 0's shard, the ranks' step channel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..engine.block_export import ExportKV
from ..engine.ranks.launch import TPLeader
from ..kvtransfer import KVBlockStore, KVShard, PackedSend, pack_sends
from ..kvtransfer.rank_report import KVExport, encode_export


class PackedChunk(NamedTuple):
    """Rank 0's slices of prompt blocks one step completed, packed on the engine thread."""
    dest_ids: list[int]
    sends: list[PackedSend]


@dataclass(frozen=True, slots=True)
class BlockPacker:
    """Tells the worker ranks (a Control, run before the next step) and packs rank 0's slices."""
    store: KVBlockStore  # over rank 0's KV cache
    shard: KVShard  # rank 0's
    leader: TPLeader | None  # the worker ranks' step channel (None: a single-rank node)

    def __call__(self, export: ExportKV, src_ids: list[int], dest_ids: list[int]) -> PackedChunk:
        if self.leader is not None:
            self.leader.send_control("kv_export", encode_export(KVExport(
                request_id=export.request_id, transfer_id=export.transfer_id, addrs=export.addrs, src_ids=src_ids,
                dest_ids=dest_ids)))
        return PackedChunk(dest_ids, pack_sends(self.store, self.shard, len(export.addrs), src_ids))
