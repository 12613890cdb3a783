"""A node's KV cache seen as an array of blocks: allocation, pack, write, read, checksum.

Owns: allocating a cache tensor (on any torch device, or on the CPU in POSIX shared
memory under /dev/shm, so another process on the host can map it), gathering blocks
into their packed form (``layout.py`` draws it), landing verified blocks, and in-place
block checksums. Must not: know about sockets, peers or transfers, or import the model.

Contracts:
- The cache is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
  C-contiguous, on the store's device (CPU or a GPU), with the layout's dtype.
- A store hashes blocks with ``checksum_algo``: xxh3_64 by default on the CPU (fast
  there), wsum32_v1 on a GPU (torch ops on the device, ``checksum.py``).
- ``pack`` is one gather (``index_select``) on the cache's device. A CPU store hashing
  with xxh3 returns one read-write byte view; any other store returns ``PackedBlocks``
  (``packed.py``: device tensor, host bytes on demand). ``split`` cuts either into the
  per-block items a sender takes. No copy beyond the gather (and the one into pinned
  host memory when a byte transport asks for it).
- ``write`` / ``write_many`` copy packed bytes into destination blocks and never check
  them; ``land`` verifies each block's checksum first (on the device for wsum32_v1)
  and writes only the good ones (the receivers use it).
- ``checksum(data)`` of a packed block equals ``store.checksums([b])[0]`` of an xxh3
  store; ``checksums(ids, algo)`` reads the cache in place (xxh3 on the CPU) or
  gathers the blocks and sums them on the device.
- Every method that moves or hashes blocks takes ``heads`` (a ``HeadRange`` local to this
  cache, default all): the slice of each block holding those KV heads, packed as a block
  of ``layout.with_heads(heads.size)`` (``layout.py``). A tensor-parallel transfer packs
  on the sender the slice a decode rank needs and lands it at that rank's head offset::

      cache [layers, 2, blocks, bs, heads, hd]      slice of block b, heads [a, c):
                                      ^^^^^         cache[:, :, b, :, a:c, :] -> [layers, 2, bs, c-a, hd]
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import xxhash

from ..common.kv_heads import HeadRange
from .checksum import checksum, packed_sums
from .layout import KVLayout
from .packed import PackedBlocks
from .wire import CHECKSUM_ALGOS, CHECKSUM_WSUM, CHECKSUM_XXH3

__all__ = ["CHECKSUM_ALGO", "KVBlockStore", "allocate_kv_cache", "byte_view", "checksum",
           "default_checksum_algo", "free_shared_kv_cache", "map_shared_kv_cache",
           "shared_kv_cache", "shm_path"]

SHM_DIR = "/dev/shm"
CHECKSUM_ALGO = CHECKSUM_XXH3  # what a host (CPU) store and sender name in the handshake


def default_checksum_algo(device: str | torch.device) -> str:
    """xxh3_64 on the CPU (~30x faster there), wsum32_v1 (computed on the device) elsewhere."""
    return CHECKSUM_XXH3 if torch.device(device).type == "cpu" else CHECKSUM_WSUM


def byte_view(obj) -> memoryview:
    """A flat ``'B'`` memoryview of a buffer or a C-contiguous CPU tensor (no copy)."""
    if isinstance(obj, torch.Tensor):
        obj = obj.reshape(-1).view(torch.uint8).numpy()
    view = obj if isinstance(obj, memoryview) else memoryview(obj)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def torch_dtype(layout: KVLayout) -> torch.dtype:
    return getattr(torch, layout.dtype)


def shm_path(shm_name: str) -> str:
    if not shm_name or "/" in shm_name or shm_name.startswith("."):
        raise ValueError(f"shm_name: must be a plain file name (no '/'), got {shm_name!r}")
    return os.path.join(SHM_DIR, shm_name)


def _map(fd: int, nbytes: int, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # The tensor keeps the mapping alive; it is unmapped when the last view is gone.
    return torch.frombuffer(mapping, dtype=torch_dtype(layout)).view(layout.cache_shape(num_blocks))


def allocate_kv_cache(layout: KVLayout, num_blocks: int, shm_name: str | None = None,
                      device: str | torch.device = "cpu") -> torch.Tensor:
    """A zeroed cache ``[layers, 2, num_blocks, block_size, heads, head_dim]`` on ``device``.

    With ``shm_name`` the memory is the file /dev/shm/<shm_name>, created here
    (it must not exist) and shared with any process that maps it
    (``map_shared_kv_cache``). The file outlives this tensor: the owner removes it
    with ``free_shared_kv_cache`` or allocates through ``shared_kv_cache``.
    """
    assert num_blocks >= 1, f"num_blocks must be >= 1, got {num_blocks}"
    if shm_name is None:
        return torch.zeros(layout.cache_shape(num_blocks), dtype=torch_dtype(layout), device=device)
    if torch.device(device).type != "cpu":
        raise ValueError(f"shm_name: a /dev/shm cache lives in host memory, device is {device}; "
                         f"use the ipc backend for a GPU pool")
    path, nbytes = shm_path(shm_name), num_blocks * layout.block_nbytes
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise FileExistsError(f"shm_name: {path} already exists (a live cache or one left by a "
                              f"crashed process); pick another name or free_shared_kv_cache"
                              f"({shm_name!r})") from None
    try:
        os.ftruncate(fd, nbytes)  # tmpfs pages read as zeros until written
        return _map(fd, nbytes, layout, num_blocks)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def map_shared_kv_cache(shm_name: str, layout: KVLayout) -> torch.Tensor:
    """Map another process's shared cache (read-write). The block count follows from the
    file size. Raises FileNotFoundError if the name is not visible from this host/container,
    ValueError if its size is not a whole number of ``layout`` blocks."""
    path = shm_path(shm_name)
    fd = os.open(path, os.O_RDWR)
    try:
        nbytes = os.fstat(fd).st_size
        if nbytes == 0 or nbytes % layout.block_nbytes:
            raise ValueError(f"{path} holds {nbytes} bytes, not a whole number of "
                             f"{layout.block_nbytes}-byte blocks of {layout}")
        return _map(fd, nbytes, layout, nbytes // layout.block_nbytes)
    finally:
        os.close(fd)


def free_shared_kv_cache(shm_name: str) -> None:
    """Remove /dev/shm/<shm_name> (idempotent). Mappings still open stay valid until dropped."""
    try:
        os.unlink(shm_path(shm_name))
    except FileNotFoundError:
        pass


@contextmanager
def shared_kv_cache(layout: KVLayout, num_blocks: int, shm_name: str) -> Iterator[torch.Tensor]:
    """``allocate_kv_cache(..., shm_name)`` that removes the shared file on exit."""
    try:
        yield allocate_kv_cache(layout, num_blocks, shm_name)
    finally:
        free_shared_kv_cache(shm_name)


class KVBlockStore:
    """Block-level access to one cache tensor. ``shm_name``: the cache's /dev/shm name, when it
    was allocated there (the shm receiver advertises it). ``checksum_algo``: how this store
    hashes blocks (default: ``default_checksum_algo`` of the cache's device)."""

    def __init__(self, kv_caches: torch.Tensor, layout: KVLayout, shm_name: str | None = None,
                 checksum_algo: str | None = None):
        assert kv_caches.is_contiguous(), "KVBlockStore: the cache must be C-contiguous"
        layout.check_compatible(KVLayout.of_cache(kv_caches.shape, kv_caches.dtype))
        self.checksum_algo = checksum_algo or default_checksum_algo(kv_caches.device)
        assert self.checksum_algo in CHECKSUM_ALGOS, f"unknown checksum algorithm {self.checksum_algo!r}"
        self.kv_caches = kv_caches  # [layers, 2, num_blocks, block_size, heads, head_dim]
        self.layout = layout
        self.shm_name = shm_name
        self.device = kv_caches.device
        self.num_blocks = kv_caches.shape[2]
        self._by_block = kv_caches.permute(2, 0, 1, 3, 4, 5)  # [num_blocks, layers, 2, bs, heads, hd]
        self._host = self.device.type == "cpu" and self.checksum_algo == CHECKSUM_XXH3
        # the whole cache as bytes, for in-place xxh3 (CPU only)
        self._flat = byte_view(kv_caches) if self.device.type == "cpu" else None

    def slice_layout(self, heads: HeadRange | None = None) -> KVLayout:
        """The layout of the slice ``heads`` of a block (the store's own for all heads)."""
        return self._slice(heads)[0]

    def pack(self, block_ids: Sequence[int], out: torch.Tensor | None = None,
             heads: HeadRange | None = None) -> memoryview | PackedBlocks:
        """The blocks (their slice ``heads``), packed (layout.py), back to back in the given
        order: one gather on the cache's device. ``out``: optional reusable ``[n, *block_shape]``
        tensor (the slice's) of the cache dtype and device. A byte view for a CPU xxh3 store,
        else ``PackedBlocks``."""
        self._check_ids(block_ids)
        layout, view = self._slice(heads)
        idx = torch.as_tensor(block_ids, dtype=torch.long).to(self.device)
        if out is None:
            out = torch.empty((len(block_ids), *layout.block_shape), dtype=self.kv_caches.dtype,
                              device=self.device)
        assert out.is_contiguous() and out.shape == (len(block_ids), *layout.block_shape)
        torch.index_select(view, 0, idx, out=out)
        return byte_view(out) if self._host else PackedBlocks(out, layout)

    def split(self, packed, heads: HeadRange | None = None) -> list:
        """Per-block items of ``packed``: views of a byte buffer (a whole number of packed
        blocks, or of slices ``heads``), or the rows of ``PackedBlocks``."""
        if isinstance(packed, PackedBlocks):
            return packed.rows()
        view, n = byte_view(packed), self._slice(heads)[0].block_nbytes
        assert len(view) % n == 0, f"{len(view)} bytes is not a whole number of {n}-byte blocks"
        return [view[i:i + n] for i in range(0, len(view), n)]

    def read(self, block_id: int, heads: HeadRange | None = None) -> bytes:
        """A copy of one block (its slice ``heads``), packed."""
        packed = self.pack([block_id], heads=heads)
        return bytes(packed.host() if isinstance(packed, PackedBlocks) else packed)

    def write(self, block_id: int, data, heads: HeadRange | None = None) -> None:
        """Copy one packed block (or slice ``heads``) into block ``block_id``."""
        self.write_many([block_id], data, heads)

    def write_many(self, block_ids: Sequence[int], data, heads: HeadRange | None = None) -> None:
        """Copy ``len(block_ids)`` packed blocks (or slices ``heads``), back to back in ``data``,
        into those blocks."""
        self._check_ids(block_ids)
        layout, view = self._slice(heads)
        src = self._as_blocks(data, len(block_ids), layout)
        if self.device.type != "cpu":
            self.scatter(block_ids, src.to(self.device), heads)
            return
        for i, block_id in enumerate(block_ids):  # one strided copy per block, layers inside torch
            view[block_id].copy_(src[i])

    def land(self, dests: Sequence[int | None], data, expected: Sequence[int], algo: str,
             heads: HeadRange | None = None) -> list[bool]:
        """Verify packed blocks (or slices ``heads``), back to back in host ``data``, against
        ``expected`` under ``algo`` and write the good ones to ``dests``. A ``None``
        destination is skipped (reported False). On a device: one upload, sums on the
        device, one scatter."""
        n = len(dests)
        self._check_ids([d for d in dests if d is not None])
        layout, cache = self._slice(heads)
        view, size = byte_view(data), layout.block_nbytes
        assert len(view) == n * size, f"expected {n} blocks of {size} bytes, got {len(view)} bytes"
        if self.device.type == "cpu" and algo == CHECKSUM_XXH3:
            ok = []
            for i, d in enumerate(dests):  # copy each block right after hashing it, while in cache
                block = view[i * size:(i + 1) * size]
                ok.append(d is not None and checksum(block) == expected[i])
                if ok[-1]:
                    cache[d].copy_(self._as_blocks(block, 1, layout)[0])
            return ok
        blocks = self._as_blocks(view, n, layout).to(self.device)  # [n, *slice block_shape]
        sums = packed_sums(blocks, layout, algo, host=view)
        good = {i: d for i, (d, s, e) in enumerate(zip(dests, sums, expected))
                if d is not None and s == e}  # row -> destination block
        if good:
            self.scatter(list(good.values()), blocks[torch.as_tensor(list(good), device=self.device)], heads)
        return [i in good for i in range(n)]

    def scatter(self, block_ids: Sequence[int], blocks: torch.Tensor, heads: HeadRange | None = None) -> None:
        """Write packed blocks (or slices ``heads``) ``[n, *block_shape]``, already on this
        store's device, into ``block_ids`` with one indexed copy (the ipc sender writes a
        peer's pool with it). On a GPU it returns once the copy ran: the blocks are reported
        landed right after, and the engine (another thread, maybe another stream) may read
        them from then on."""
        self._check_ids(block_ids)
        layout, _ = self._slice(heads)
        assert blocks.shape == (len(block_ids), *layout.block_shape) and blocks.device == self.device
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        if heads is None or layout is self.layout:
            self._by_block[idx] = blocks
        else:
            self._by_block[idx, :, :, :, heads.start:heads.stop] = blocks
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def checksums(self, block_ids: Sequence[int], algo: str | None = None,
                  heads: HeadRange | None = None) -> list[int]:
        """Checksum (``algo``, default the store's) of each block's packed bytes (or its
        slice ``heads``), as they sit in the cache: read in place for xxh3 of whole blocks on
        the CPU, else gathered and summed (on the device for wsum32_v1).

        In place, xxh3 hashes the block's ``2 * num_layers`` runs in packed order with a
        streaming xxh3, which equals the one-shot hash of the packed block. Measured faster
        than pack-then-hash (5.4 vs ~2.7 GB/s) since it reads each byte once.
        """
        algo = algo or self.checksum_algo
        self._check_ids(block_ids)
        layout, view = self._slice(heads)
        if algo != CHECKSUM_XXH3 or self._flat is None or layout is not self.layout:
            if not block_ids:
                return []
            idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
            blocks = torch.index_select(view, 0, idx)
            return PackedBlocks(blocks, layout).sums(algo)
        run = self.layout.run_nbytes
        stride = self.num_blocks * run  # bytes from one (layer, K|V) run to the next
        runs = 2 * self.layout.num_layers
        flat, out = self._flat, []
        for block_id in block_ids:
            h = xxhash.xxh3_64()
            for off in range(block_id * run, block_id * run + runs * stride, stride):
                h.update(flat[off:off + run])
            out.append(h.intdigest())
        return out

    def host_buffer(self, nbytes: int) -> memoryview:
        """A writable host buffer for receiving packed blocks: pinned memory when the cache is
        on a GPU (fast upload), a plain bytearray on the CPU."""
        if self.device.type == "cuda":
            return byte_view(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        return memoryview(bytearray(nbytes))
    def _slice(self, heads: HeadRange | None) -> tuple[KVLayout, torch.Tensor]:
        """(layout of slice ``heads``, the cache by block restricted to those heads:
        ``[num_blocks, layers, 2, bs, heads.size, hd]``); all heads: the store's own."""
        if heads is None or (heads.start == 0 and heads.stop == self.layout.num_kv_heads):
            return self.layout, self._by_block
        assert 0 <= heads.start < heads.stop <= self.layout.num_kv_heads, \
            f"heads [{heads.start}, {heads.stop}) out of this cache's [0, {self.layout.num_kv_heads})"
        return self.layout.with_heads(heads.size), self._by_block[:, :, :, :, heads.start:heads.stop]

    def _as_blocks(self, data, n: int, layout: KVLayout | None = None) -> torch.Tensor:
        layout = layout or self.layout
        view = byte_view(data)
        assert len(view) == n * layout.block_nbytes, \
            f"expected {n} blocks of {layout.block_nbytes} bytes, got {len(view)} bytes"
        if view.readonly:  # torch warns on read-only buffers; we only ever read from it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(view, dtype=self.kv_caches.dtype)
        else:
            flat = torch.frombuffer(view, dtype=self.kv_caches.dtype)
        return flat.view(n, *layout.block_shape)

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            assert 0 <= b < self.num_blocks, f"block id {b} out of range [0, {self.num_blocks})"
