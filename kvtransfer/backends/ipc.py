"""The same-host CUDA backend: the sender copies blocks device to device straight into
the receiver's KV pool, opened through a CUDA IPC handle, and sends only a notice
(ids, checksums) over TCP.

Owns: ``IpcSender`` / ``IpcReceiver``, exporting a pool as ``wire.IpcInfo`` and opening
one. Must not: allocate either pool (the nodes' engines do), move block bytes through
host memory, or import the model. Importing it needs no GPU; using it does.

::

    prefill process (cuda:i)                           decode process (cuda:j, same host)
    TCP dial host:P  -- Hello(wsum32_v1) ------------>  TCP listener :P
                     <-- Welcome(ipc=IpcInfo) --------  reduce_tensor(pool): handle, offsets
    open the handle once per connection (rebuild_cuda_tensor, device found by its UUID)
    per frame:  packed rows [n, *block_shape] (device) --copy (peer to peer if i != j)-->
                index_put into the peer pool's blocks; synchronize the device
                -- Blocks(ids, checksums, payload_nbytes=0) -->  wsum32_v1 of the blocks in
                                                                 place, on cuda:j --> on_block

The checksums are wsum32_v1 on both sides (``checksum.py``): the sender's over the rows
it packed, the receiver's over the blocks where they landed, so a copy that went wrong
fails the transfer and the decode node falls back to prefilling locally.
A sender on another host (other boot id), or one that cannot see the pool's GPU, gets a
``TransferError`` naming tcp (pinned host staging) as the way across.
"""

from __future__ import annotations

import torch

from ..block_store import KVBlockStore
from ..errors import TransferError
from ..layout import KVLayout
from ..packed import PackedBlock, flip_rows, frame_sums, frame_tensor, frame_views
from ..sender_core import Peer, Slice
from .shm import host_id, require_same_host
from .tcp import TcpConnection, TcpReceiver, TcpSender
from ..wire import CHECKSUM_WSUM, Blocks, IpcInfo, Welcome


def check_cuda(role: str) -> None:
    """Raise ``TransferError`` unless this process can use CUDA."""
    if not torch.cuda.is_available():
        raise TransferError(f"the ipc backend ({role}) needs CUDA: torch {torch.__version__} sees no "
                            f"GPU here; use --kv-backend tcp (or shm between CPU nodes)")


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device(uuid: str) -> int:
    """This process's index of the GPU with ``uuid`` (CUDA_VISIBLE_DEVICES may renumber)."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise TransferError(f"the receiver's GPU {uuid} is not visible to this process "
                        f"(CUDA_VISIBLE_DEVICES?); use the tcp backend")


def export_pool(pool: torch.Tensor) -> IpcInfo:
    """The IPC description of a CUDA pool ``[layers, 2, num_blocks, bs, heads, head_dim]``."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(pool)
    (_, size, stride, offset, _, dtype, device, handle, storage_size, storage_offset, _,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return IpcInfo(host_id=host_id(), device_uuid=device_uuid(device), shape=list(size),
                   stride=list(stride), offset=offset, dtype=str(dtype).removeprefix("torch."),
                   handle=handle, storage_size_bytes=storage_size, storage_offset_bytes=storage_offset,
                   ref_counter_handle=ref_handle, ref_counter_offset=ref_offset,
                   event_handle=event_handle, event_sync_required=event_sync)


def open_pool(info: IpcInfo) -> torch.Tensor:
    """Map another process's pool into this one (read-write, on the same physical GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = local_device(info.device_uuid)
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(info.shape), tuple(info.stride), info.offset,
                               torch.storage.TypedStorage, getattr(torch, info.dtype), device,
                               info.handle, info.storage_size_bytes, info.storage_offset_bytes, False,
                               info.ref_counter_handle, info.ref_counter_offset, info.event_handle,
                               info.event_sync_required)


class IpcReceiver(TcpReceiver):
    """A TCP receiver whose store is a CUDA pool that same-host senders write into.
    Senders of other backends' byte frames (tcp) land as on a tcp receiver."""

    scheme = "ipc"

    def __init__(self, layout: KVLayout, store: KVBlockStore, *args, **kwargs):
        check_cuda("receiver")
        if store.device.type != "cuda":
            raise ValueError(f"ipc receiver: the KV pool must be on a CUDA device, it is on {store.device}; "
                             f"run the node with --device cuda or use the tcp backend")
        super().__init__(layout, store, *args, **kwargs)

    def _offers_shm(self) -> bool:
        return True  # frames without payload: the sender already wrote them into our pool

    def _welcome(self, conn: TcpConnection) -> Welcome:
        # one export per connection: each takes one count of torch's IPC reference counter,
        # which that sender's mapping gives back when it is dropped
        return Welcome(layout=self.layout, num_blocks=self.store.num_blocks, ipc=export_pool(self.store.kv_caches))


class IpcSender(TcpSender):
    """Opens each receiver's pool once per connection; frames carry no payload."""

    scheme = "ipc"

    def __init__(self, layout: KVLayout, options=None, device: str | torch.device = "cuda", shard=None):
        super().__init__(layout, options, shard)
        check_cuda("sender")
        if self.checksum_algo != CHECKSUM_WSUM:
            raise ValueError(f"ipc sender: checksum must be {CHECKSUM_WSUM} (computed on the device), "
                             f"got {self.checksum_algo!r}")
        self.device = torch.device(device)

    async def _on_welcome(self, peer: Peer[TcpConnection]) -> None:
        info = peer.welcome.ipc
        if info is None:
            raise TransferError(f"receiver {peer.addr} offers no CUDA IPC pool; use its backend (tcp)")
        require_same_host("ipc", peer.addr, info.host_id, "the tcp backend")
        try:
            pool = open_pool(info)
        except RuntimeError as e:  # cudaIpcOpenMemHandle failed (another container, same process)
            raise TransferError(f"cannot open receiver {peer.addr}'s CUDA IPC pool: {e}; use tcp") from e
        layout = peer.welcome.layout  # the receiver's rank's heads (checked against its shard)
        if list(pool.shape) != list(layout.cache_shape(pool.shape[2])):
            raise TransferError(f"receiver {peer.addr}'s pool has shape {list(pool.shape)}, not a "
                                f"cache of {layout}")
        peer.store = KVBlockStore(pool, layout)

    def _stage(self, peer: Peer[TcpConnection], dest: list[int], items: list,
               corrupt: list[int], part: Slice) -> tuple[list[int], list[memoryview]]:
        """Checksum the rows (slices ``part``) on the device, copy them into the peer pool at
        the slice's heads, wait for the copy."""
        store = peer.store
        assert store is not None  # set by _on_welcome before the connection carries a frame
        sums = frame_sums(items, part.layout, self.checksum_algo)
        if all(isinstance(it, PackedBlock) for it in items):
            src = frame_tensor(items)  # [n, *block_shape] on this node's device
        else:  # host buffers (a CPU-packed frame): one upload
            joined = b"".join(bytes(v) for v in frame_views(items))
            src = torch.frombuffer(bytearray(joined), dtype=store.kv_caches.dtype).view(
                len(items), *part.layout.block_shape)
        src = src.to(store.device)  # peer to peer when the pools are on two GPUs
        if corrupt:  # fault injection: damage a copy after the checksum was taken
            src = flip_rows(src, corrupt)
        store.scatter(dest, src, part.peer_local)  # returns once the copy ran: the receiver verifies on the notice
        return sums, []

    async def _deliver(self, peer: Peer[TcpConnection], frame: Blocks, payload: list[memoryview]) -> None:
        frame.payload_nbytes = 0  # the blocks are already in the receiver's pool
        await peer.conn.send(frame)
