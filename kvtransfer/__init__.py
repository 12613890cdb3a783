"""KV block transport: interface, backends (tcp, shm, ucx, nccl, ipc), wire layout of a block,
handshake, and the per-transfer state machine.

Must not import the model (``splitserve.engine``). The nodes use::

    layout = KVLayout(dtype, block_size, num_layers, num_kv_heads, head_dim)
    store = KVBlockStore(kv_caches, layout[, shm_name])       # over the node's cache (CPU or GPU)
    sender = make_sender("tcp" | "shm" | "ucx" | "nccl" | "ipc", layout[, device=...])  # prefill node
    await sender.send_blocks(addr, transfer_id, list(zip(dest_ids, store.split(store.pack(src_ids)))))
    # (on a GPU, pack gathers on the device and split yields PackedBlock rows; see packed.py)
    receiver = make_receiver(backend, layout, store, host, on_block[, device=...])  # decode node
    await receiver.start(); receiver.address                   # advertise it
    table = TransferTable()                                    # decode node, fed by on_block;
    transfer = table.reserve(...); await transfer.done         # its PrefillResult or TransferFailure
"""

from .base import KVReceiver, KVSender, OnBlock
from .block_store import (KVBlockStore, allocate_kv_cache, checksum, free_shared_kv_cache, map_shared_kv_cache,
                          shared_kv_cache)
from .errors import TransferError
from .factory import make_receiver, make_sender, sender_options
from .layout import KVLayout, LayoutMismatch
from .sender_core import SenderOptions
from .state import Transfer, TransferFailure, TransferState, TransferTable

__all__ = [
    "KVBlockStore", "KVLayout", "KVReceiver", "KVSender", "LayoutMismatch", "OnBlock",
    "SenderOptions", "Transfer", "TransferError", "TransferFailure", "TransferState", "TransferTable",
    "allocate_kv_cache", "checksum", "free_shared_kv_cache", "make_receiver",
    "make_sender", "map_shared_kv_cache", "sender_options", "shared_kv_cache",
]
