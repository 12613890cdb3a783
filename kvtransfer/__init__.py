"""KV block transport: interface, backends (tcp, shm, ucx, nccl, ipc; the backend registry, with
any from outside the package, is common/kv_backends.py), wire layout of a block, handshake,
and the per-transfer state machine.

Must not import the model (``splitserve.engine``). The nodes use::

    layout = KVLayout(dtype, block_size, num_layers, num_kv_heads, head_dim)
    store = KVBlockStore(kv_caches, layout[, shm_name])       # over the node's cache (CPU or GPU)
    sender = make_sender(backend, layout[, device=...])       # prefill node; backend: "tcp", "shm", ...
    await sender.send_blocks(addr, transfer_id, list(zip(dest_ids, store.split(store.pack(src_ids)))))
    # (on a GPU, pack gathers on the device and split yields PackedBlock rows; see packed.py)
    receiver = make_receiver(backend, layout, store, host, on_block[, device=...])  # decode node
    await receiver.start(); receiver.address                   # advertise it
    table = TransferTable()                                    # decode node, fed by on_block;
    transfer = table.reserve(...); await transfer.done         # its PrefillResult or TransferFailure

With tensor parallelism each rank has its own store, sender or receiver over its shard
of the cache (``shard = KVShard(compat, rank)``, passed to make_sender / make_receiver);
a prefill rank sends with ``ShardSender(sender, store, shard).send(decode addrs, ...)``
(``tp_plan.py`` decides who sends which heads), a decode node's rank 0 keeps
``TransferTable(ranks=tp)`` and its worker ranks report through ``rank_report.py``.
"""

from .base import KVReceiver, KVSender, OnBlock
from .block_store import (KVBlockStore, allocate_kv_cache, checksum, free_shared_kv_cache, map_shared_kv_cache,
                          shared_kv_cache)
from .errors import TransferError
from .factory import make_receiver, make_sender, sender_options
from .layout import KVLayout, KVShard, LayoutMismatch
from .rank_report import (ClosedApplied, ClosedTransfers, KVExport, RankBlocks, RankReady, RankReporter, RankSent,
                          TransfersClosed)
from .sender_core import SenderOptions
from .state import Transfer, TransferFailure, TransferState, TransferTable
from .tp_plan import PlanPart, RankSend, TransferPlan, transfer_plan
from .tp_send import PackedSend, ShardSender, pack_sends

__all__ = [
    "ClosedApplied", "ClosedTransfers", "KVBlockStore", "KVExport", "KVLayout", "KVReceiver", "KVSender", "KVShard",
    "LayoutMismatch", "OnBlock", "PackedSend", "PlanPart", "RankBlocks", "RankReady", "RankReporter", "RankSend",
    "RankSent", "SenderOptions", "pack_sends",
    "ShardSender", "Transfer", "TransferError", "TransferFailure", "TransferPlan", "TransferState",
    "TransferTable", "TransfersClosed", "allocate_kv_cache", "checksum", "free_shared_kv_cache",
    "make_receiver", "make_sender", "map_shared_kv_cache", "sender_options", "shared_kv_cache",
    "transfer_plan",
]
