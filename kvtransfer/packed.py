"""Packed blocks gathered from a device pool, and what a sender needs of them.

Owns: ``PackedBlocks`` (one gather's output, on the pool's device), ``PackedBlock`` (one
row of it, what ``KVBlockStore.split`` hands a sender), their host bytes (one copy into
pinned staging, made on first use and kept) and their checksums (computed once per
algorithm, on the device for wsum32_v1), plus ``frame_sums`` / ``frame_views``, which
accept these rows or plain host buffers alike. Must not: do I/O or import the model.

::

    pool (device) --index_select--> PackedBlocks.blocks [n, *block_shape] (device)
                                      |-- sums(algo): run sums on the device, n*2L int64 to host
                                      |-- host(): one copy into pinned host memory (tcp, ucx, nccl)
                                      '-- rows: the ipc backend copies them device to device

On the CPU ``host()`` is a view of ``blocks`` (no copy). The buffers must stay unchanged
until the transfer returns; each pack makes fresh ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .checksum import bytes_sum, packed_sums
from .layout import KVLayout
from .wire import CHECKSUM_WSUM


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a C-contiguous CPU tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


class PackedBlocks:
    """``blocks``: ``[n, *layout.block_shape]`` packed blocks, contiguous, on the pool's device."""

    def __init__(self, blocks: torch.Tensor, layout: KVLayout):
        assert blocks.is_contiguous() and blocks.shape[1:] == layout.block_shape
        self.blocks = blocks
        self.layout = layout
        self._host: memoryview | None = None
        self._sums: dict[str, list[int]] = {}  # algo -> checksum of each block
        # The gather was queued on the packing thread's stream (the engine's); whoever reads
        # the blocks later (the event loop's thread, another stream) waits for it first.
        self._ready = None
        if blocks.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()

    def wait(self) -> None:
        """Block until the gather that filled ``blocks`` has run (no-op on the CPU)."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None

    def __len__(self) -> int:
        return self.blocks.shape[0]

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def host(self) -> memoryview:
        """The blocks' bytes in host memory: a view on the CPU, else one copy into pinned memory."""
        if self._host is None:
            self.wait()
            if self.blocks.device.type == "cpu":
                self._host = _host_bytes(self.blocks)
            else:
                staging = torch.empty(self.blocks.shape, dtype=self.blocks.dtype, pin_memory=True)
                staging.copy_(self.blocks)  # synchronous: the bytes are there on return
                self._host = _host_bytes(staging)
        return self._host

    def sums(self, algo: str) -> list[int]:
        """The checksum of each block under ``algo`` (wsum32_v1 on the device)."""
        if algo not in self._sums:
            self.wait()
            host = None if algo == CHECKSUM_WSUM else self.host()  # xxh3 hashes host bytes
            self._sums[algo] = packed_sums(self.blocks, self.layout, algo, host)
        return self._sums[algo]

    def rows(self) -> list[PackedBlock]:
        return [PackedBlock(self, i) for i in range(len(self))]


class PackedBlock(NamedTuple):
    """Row ``row`` of ``packed``: one packed block, as ``KVBlockStore.split`` returns it."""

    packed: PackedBlocks
    row: int  # not ``index``, which would shadow tuple.index

    @property
    def nbytes(self) -> int:
        return self.packed.layout.block_nbytes

    def view(self) -> memoryview:
        n = self.nbytes
        return self.packed.host()[self.row * n:(self.row + 1) * n]

    def tensor(self) -> torch.Tensor:
        return self.packed.blocks[self.row]  # [*block_shape] on the pool's device


def item_nbytes(item) -> int:
    """Bytes of one block handed to ``send_blocks``: a ``PackedBlock`` or any host buffer."""
    if isinstance(item, PackedBlock):
        return item.nbytes
    return memoryview(item).nbytes


def frame_sums(items: Sequence, layout: KVLayout, algo: str) -> list[int]:
    """``algo`` checksum of each item: a ``PackedBlock``'s comes from its batch (computed
    once for the whole pack), a host buffer is hashed here."""
    return [it.packed.sums(algo)[it.row] if isinstance(it, PackedBlock) else bytes_sum(it, layout, algo)
            for it in items]


def frame_views(items: Sequence) -> list[memoryview]:
    """Host bytes of each item (a ``PackedBlock`` stages its whole batch once)."""
    out = []
    for it in items:
        if isinstance(it, PackedBlock):
            out.append(it.view())
        else:
            view = it if isinstance(it, memoryview) else memoryview(it)
            out.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return out


def flip_rows(blocks: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Fault injection on the device: a copy of ``blocks`` ``[n, *block_shape]`` with the
    middle byte of each row in ``rows`` inverted (the device twin of ``flip_one_byte``)."""
    out = blocks.clone()
    for i in rows:
        flat = out[i].view(-1).view(torch.uint8)
        mid = flat.numel() // 2
        flat[mid:mid + 1].bitwise_xor_(0xFF)
    return out


def frame_tensor(items: Sequence[PackedBlock]) -> torch.Tensor:
    """The items' blocks as one ``[n, *block_shape]`` device tensor: a slice of their batch
    when they are consecutive rows of one pack (the usual case), else one gather."""
    first = items[0]
    for it in items:
        it.packed.wait()
    if all(isinstance(it, PackedBlock) and it.packed is first.packed and it.row == first.row + k
           for k, it in enumerate(items)):
        return first.packed.blocks[first.row:first.row + len(items)]
    assert all(isinstance(it, PackedBlock) for it in items), "device copies need packed device blocks"
    return torch.stack([it.tensor() for it in items])
