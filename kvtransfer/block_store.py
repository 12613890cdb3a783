"""A node's KV cache seen as an array of blocks: allocation, pack, write, read, checksum.

Owns: allocating a cache tensor (optionally in POSIX shared memory under
/dev/shm, so another process on the host can map it), the packed byte form of
blocks (``layout.py`` draws it), and the block checksum (xxh3_64, ~4x faster
than zlib.crc32 here: 7.8 vs 2.1 GB/s). Must not: know about sockets, peers or
transfers, or import the model.

Contracts:
- The cache is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
  C-contiguous, on the CPU, with the layout's dtype (checked at construction).
- ``pack`` returns one read-write byte view holding the blocks in the given order;
  ``split`` cuts it into per-block views. Both are views: no copy beyond the one gather.
- ``write`` / ``write_many`` copy packed bytes into destination blocks and never
  check them; callers verify checksums first (the receivers do).
- ``checksum(data)`` of a packed block equals ``store.checksums([b])[0]`` of the
  block it was packed from: the latter reads the cache in place, run by run.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import xxhash

from splitserve.kvtransfer.layout import KVLayout

SHM_DIR = "/dev/shm"
CHECKSUM_ALGO = "xxh3_64"  # named in every handshake: both ends must hash alike


def checksum(data) -> int:
    """xxh3_64 of a bytes-like object (any C-contiguous buffer), as an unsigned 64-bit int."""
    return xxhash.xxh3_64_intdigest(data)


def byte_view(obj) -> memoryview:
    """A flat ``'B'`` memoryview of a buffer or a C-contiguous CPU tensor (no copy)."""
    if isinstance(obj, torch.Tensor):
        obj = obj.reshape(-1).view(torch.uint8).numpy()
    view = obj if isinstance(obj, memoryview) else memoryview(obj)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def torch_dtype(layout: KVLayout) -> torch.dtype:
    return getattr(torch, layout.dtype)


def layout_of(kv_caches: torch.Tensor) -> KVLayout:
    """The layout of an existing cache tensor ``[layers, 2, blocks, block_size, heads, head_dim]``."""
    num_layers, two, _, block_size, heads, head_dim = kv_caches.shape
    assert two == 2, f"kv_caches dim 1 must be 2 (K, V), got shape {tuple(kv_caches.shape)}"
    return KVLayout(dtype=str(kv_caches.dtype).removeprefix("torch."), block_size=block_size,
                    num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim)


def shm_path(shm_name: str) -> str:
    if not shm_name or "/" in shm_name or shm_name.startswith("."):
        raise ValueError(f"shm_name: must be a plain file name (no '/'), got {shm_name!r}")
    return os.path.join(SHM_DIR, shm_name)


def _map(fd: int, nbytes: int, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # The tensor keeps the mapping alive; it is unmapped when the last view is gone.
    return torch.frombuffer(mapping, dtype=torch_dtype(layout)).view(layout.cache_shape(num_blocks))


def allocate_kv_cache(layout: KVLayout, num_blocks: int, shm_name: str | None = None) -> torch.Tensor:
    """A zeroed cache ``[layers, 2, num_blocks, block_size, heads, head_dim]``.

    With ``shm_name`` the memory is the file /dev/shm/<shm_name>, created here
    (it must not exist) and shared with any process that maps it
    (``map_shared_kv_cache``). The file outlives this tensor: the owner removes it
    with ``free_shared_kv_cache`` or allocates through ``shared_kv_cache``.
    """
    assert num_blocks >= 1, f"num_blocks must be >= 1, got {num_blocks}"
    if shm_name is None:
        return torch.zeros(layout.cache_shape(num_blocks), dtype=torch_dtype(layout))
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
    was allocated there (the shm receiver advertises it)."""

    def __init__(self, kv_caches: torch.Tensor, layout: KVLayout, shm_name: str | None = None):
        assert kv_caches.device.type == "cpu", "KVBlockStore: the cache must be on the CPU"
        assert kv_caches.is_contiguous(), "KVBlockStore: the cache must be C-contiguous"
        layout.check_compatible(layout_of(kv_caches))
        self.kv_caches = kv_caches  # [layers, 2, num_blocks, block_size, heads, head_dim]
        self.layout = layout
        self.shm_name = shm_name
        self.num_blocks = kv_caches.shape[2]
        self._by_block = kv_caches.permute(2, 0, 1, 3, 4, 5)  # [num_blocks, layers, 2, bs, heads, hd]
        self._flat = byte_view(kv_caches)  # the whole cache, for in-place checksums

    def pack(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> memoryview:
        """The blocks, packed (layout.py), back to back in the given order: one gather.
        ``out``: optional reusable ``[n, *layout.block_shape]`` tensor of the cache dtype."""
        self._check_ids(block_ids)
        idx = torch.as_tensor(block_ids, dtype=torch.long)
        if out is None:
            out = torch.empty((len(block_ids), *self.layout.block_shape), dtype=self.kv_caches.dtype)
        assert out.is_contiguous() and out.shape == (len(block_ids), *self.layout.block_shape)
        torch.index_select(self._by_block, 0, idx, out=out)
        return byte_view(out)

    def split(self, packed) -> list[memoryview]:
        """Per-block views of ``packed`` (a whole number of packed blocks)."""
        view, n = byte_view(packed), self.layout.block_nbytes
        assert len(view) % n == 0, f"{len(view)} bytes is not a whole number of {n}-byte blocks"
        return [view[i:i + n] for i in range(0, len(view), n)]

    def read(self, block_id: int) -> bytes:
        """A copy of one block, packed."""
        return bytes(self.pack([block_id]))

    def write(self, block_id: int, data) -> None:
        """Copy one packed block (``block_nbytes`` bytes) into block ``block_id``."""
        self._check_ids([block_id])
        self._by_block[block_id].copy_(self._as_blocks(data, 1)[0])

    def write_many(self, block_ids: Sequence[int], data) -> None:
        """Copy ``len(block_ids)`` packed blocks, back to back in ``data``, into those blocks."""
        self._check_ids(block_ids)
        src = self._as_blocks(data, len(block_ids))
        for i, block_id in enumerate(block_ids):  # one strided copy per block, layers inside torch
            self._by_block[block_id].copy_(src[i])

    def checksums(self, block_ids: Sequence[int]) -> list[int]:
        """``checksum`` of each block's packed bytes, read in place (no gather copy).

        Hashes the block's ``2 * num_layers`` runs in packed order with a streaming
        xxh3, which equals the one-shot hash of the packed block. Measured faster
        than pack-then-hash (5.4 vs ~2.7 GB/s) since it reads each byte once.
        """
        self._check_ids(block_ids)
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

    def _as_blocks(self, data, n: int) -> torch.Tensor:
        view = byte_view(data)
        assert len(view) == n * self.layout.block_nbytes, \
            f"expected {n} blocks of {self.layout.block_nbytes} bytes, got {len(view)} bytes"
        if view.readonly:  # torch warns on read-only buffers; we only ever read from it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(view, dtype=self.kv_caches.dtype)
        else:
            flat = torch.frombuffer(view, dtype=self.kv_caches.dtype)
        return flat.view(n, *self.layout.block_shape)

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            assert 0 <= b < self.num_blocks, f"block id {b} out of range [0, {self.num_blocks})"
