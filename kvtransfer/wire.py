"""The messages of the KV transfer protocol, shared by every backend.

Owns: the message structs and their msgpack encoding. Must not: do I/O (each
backend's connection frames these bytes its own way) or import torch.

A connection, sender on the left::

    Hello(shard, layout, checksum algo, version) -->
                                                 <--  Welcome(shard, layout, shm?)  |  Refused(reason), then close
    Blocks(seq=0, transfer, dest ids, heads, sums) + payload  -->
    Blocks(seq=1, ...)           + payload       -->     (frames of concurrent transfers interleave;
                                                 <--  Ack(seq=0, failed)      each frame is one unit)
                                                 <--  Ack(seq=1, failed)

``Blocks.payload_nbytes`` bytes follow a ``Blocks`` header: the frame's blocks,
packed (``layout.py``), in ``dest_block_ids`` order, each the slice ``heads`` of the block
(global KV head numbers; every head the sender holds unless the transfer plan,
``tp_plan.py``, sends this receiver fewer) (the ucx backend carries them
on its UCX endpoint instead of the TCP stream, the nccl backend on its two-rank
process group). The shm backend sends 0: its sender already wrote the bytes into
the receiver's shared cache. Every frame repeats the sender's ``layout_id`` so a
block is never read with another layout: the layout of the slice, whose head count the
receiver checks against ``heads``.

Both ends send their ``KVShard`` (node compatibility key + rank): the receiver refuses a
sender whose key differs in anything but TP, or whose TP cannot split the heads, before
any block moves (``Refused.code`` "layout" or "tp"); the sender checks the receiver's the
same way, and that every slice it sends lies in the receiver's heads.
"""

from __future__ import annotations

import msgspec
import xxhash

from ..common.kv_heads import HeadRange
from .layout import KVLayout, KVShard

PROTOCOL_VERSION = 2  # 2: KV shards in the handshake, head slices in frames (tensor parallelism)
# Block checksum algorithms a Hello may name (``kvtransfer/checksum.py`` defines them): xxh3_64
# over the packed bytes (host senders), wsum32_v1 computed with torch ops on the pool's device.
CHECKSUM_XXH3 = "xxh3_64"
CHECKSUM_WSUM = "wsum32_v1"
CHECKSUM_ALGOS = (CHECKSUM_XXH3, CHECKSUM_WSUM)


class Hello(msgspec.Struct, tag="hello", omit_defaults=True):
    """Sender -> receiver, first message of a connection."""

    layout: KVLayout  # the sender's cache: its rank's heads
    checksum: str  # block checksum algorithm of this connection, one of CHECKSUM_ALGOS
    version: int = PROTOCOL_VERSION
    shard: KVShard | None = None  # the sender's node key and rank (senders always set it)
    want_shm: bool = False  # the sender writes through the receiver's shared cache
    group: str = ""  # nccl backend: the process group kind the sender joins, "gloo" or "nccl"
    token: str = ""  # the cluster token (common/auth.py); a receiver that has one refuses others


class ShmInfo(msgspec.Struct, tag="shm_info", omit_defaults=True):
    """Where a same-host sender finds the receiver's cache."""

    shm_name: str  # file name under /dev/shm
    num_blocks: int
    host_id: str  # the receiver's boot id: a sender with another one is on another host
    inode: tuple[int, int]  # (st_dev, st_ino) of the file, so a same-named file elsewhere is refused


class UcxInfo(msgspec.Struct, tag="ucx_info", omit_defaults=True):
    """Where a sender opens the UCX data endpoint of this connection."""

    port: int  # the receiver's UCX listener, on the host of the control address
    token: str  # hex; the sender's first UCX message, binding the endpoint to this connection


class NcclInfo(msgspec.Struct, tag="nccl_info", omit_defaults=True):
    """How a sender joins this connection's two-rank process group."""

    store_port: int  # the receiver's TCPStore, on the host of the control address
    prefix: str  # this connection's key prefix in that store


class IpcInfo(msgspec.Struct, tag="ipc_info", omit_defaults=True):
    """The receiver's CUDA KV pool as a CUDA IPC handle (the fields of
    ``torch.multiprocessing.reductions.reduce_tensor``), opened once per connection."""

    host_id: str  # the receiver's boot id: CUDA IPC works only on one host
    device_uuid: str  # the pool's GPU; the sender maps it to its own device index
    shape: list[int]  # the pool, [num_layers, 2, num_blocks, block_size, heads, head_dim]
    stride: list[int]
    offset: int  # tensor offset in its storage, elements
    dtype: str
    handle: bytes  # cudaIpcMemHandle of the allocation holding the storage
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None = None
    event_sync_required: bool = False


class Welcome(msgspec.Struct, tag="welcome", omit_defaults=True):
    """Receiver -> sender: handshake accepted."""

    layout: KVLayout  # the receiver's cache: its rank's heads
    num_blocks: int
    shard: KVShard | None = None  # the receiver's node key and rank (receivers always set it)
    shm: ShmInfo | None = None
    ucx: UcxInfo | None = None
    nccl: NcclInfo | None = None
    ipc: IpcInfo | None = None


class Refused(msgspec.Struct, tag="refused", omit_defaults=True):
    """Receiver -> sender: handshake refused; the receiver closes the connection after it."""

    reason: str
    code: str = ""  # "layout", "tp", "checksum", "version", "shm", "auth" or "" (other)


class Blocks(msgspec.Struct, tag="blocks", omit_defaults=True):
    """One frame of one transfer: up to a few MiB of blocks, acknowledged by ``Ack(seq)``."""

    seq: int  # per connection, from 0
    transfer_id: str
    layout_id: int  # layout_id(layout of the slice: the sender's, with heads.size heads)
    dest_block_ids: list[int]
    checksums: list[int]  # checksum of each packed slice, same order
    payload_nbytes: int = 0  # len(dest_block_ids) * slice block_nbytes, or 0 (shm: data already in place)
    heads: HeadRange | None = None  # global KV heads of each slice; None: all the receiver's


class Ack(msgspec.Struct, tag="ack", omit_defaults=True):
    """Receiver -> sender: frame ``seq`` was processed (on_block already called for its blocks)."""

    seq: int
    failed: list[int] = []  # dest block ids that were rejected
    reason: str | None = None  # why, for the first rejected block


Message = Hello | Welcome | Refused | Blocks | Ack

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


def decode(data) -> Message:
    """Inverse of ``encode``; raises msgspec.DecodeError / ValidationError on a bad message."""
    return _DECODER.decode(data)


def layout_id(layout: KVLayout) -> int:
    """A 63-bit fingerprint of a layout, repeated in every frame."""
    return xxhash.xxh3_64_intdigest(_ENCODER.encode(layout)) >> 1
