"""The disk tier of a prefix cache: one checksummed file per KV block under a folder,
bounded in bytes, written by one background thread, read on the engine thread.

Owns the folder's files of this engine's layout, their index (block hash -> file size,
least recently used first) and the writer thread. Must not: touch the device cache or the
host tier (engine/kv_offload.py hands it a block's bytes and takes bytes back), or raise
into the engine: a bad file, a full disk or a failed write is a miss and a ``TierFault``.

Layout::

    <dir>/<layout digest>/<block hash, hex>.kvb     one block, all layers, K and V
      b"SPLITKV1" | u32 header length (little-endian) | header (msgpack DiskHeader) | payload

The header names the model, dtype and one block's shape, so a node restarted with the
same model, dtype and layout finds its files again (the digest of those is the folder; a
file is checked against them again when read) and any other node ignores them. A read
checks the magic, header, layout, hash, the block's tokens, the size and the CRC-32 of
the payload; any mismatch deletes the file and counts ``TierFault.CORRUPT``. Files are
written to a temporary name and renamed, so a node killed while storing leaves no
half-written block under a block's name (temporaries are removed at the next start).

Threads: ``put`` queues from the engine thread; the writer thread writes, evicts the
least recently used files to stay within ``max_bytes`` and reports what it dropped;
``read``, ``contains``, ``take_dropped`` run on the engine thread. The index is shared
under one lock.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import msgspec

from ..common.outcomes import TierFault

log = logging.getLogger(__name__)

MAGIC = b"SPLITKV1"
SUFFIX = ".kvb"
QUEUE_BLOCKS = 256  # blocks waiting for the writer; beyond it a block is dropped (QUEUE_FULL)
_LEN = struct.Struct("<I")


class DiskLayout(NamedTuple):
    """What a block file must match to be read back by this engine."""
    model: str
    dtype: str
    block_shape: tuple[int, ...]  # one block: [layers, 2, block_size, kv_heads, head_dim]

    @property
    def digest(self) -> str:
        return hashlib.sha256(repr(tuple(self)).encode()).hexdigest()[:16]


class DiskHeader(msgspec.Struct, array_like=True):
    model: str
    dtype: str
    block_shape: list[int]
    block_hash: int
    tokens: list[int]
    nbytes: int
    crc32: int


class DiskWrite(NamedTuple):
    block_hash: int
    tokens: tuple[int, ...]
    payload: bytes


class DiskTier:
    """Blocks on disk for one engine layout (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, layout: DiskLayout, block_bytes: int, max_bytes: int):
        self.layout = layout
        self.block_bytes = block_bytes
        self.max_bytes = max_bytes
        self.dir = Path(root) / layout.digest
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._used = 0
        self._dropped: list[int] = []  # hashes whose file went away (evicted, failed): for the engine's events
        self._faults: list[TierFault] = []
        self.store_s = 0.0  # writer seconds and bytes written (the measured store rate)
        self.stored_bytes = 0
        self._queue: queue.Queue[DiskWrite | None] = queue.Queue(QUEUE_BLOCKS)
        self._scan()
        self._thread = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def _scan(self) -> None:
        """Index the files a previous run of this layout left, oldest first; drop temporaries."""
        found = []
        for path in self.dir.iterdir():
            if path.suffix != SUFFIX:
                path.unlink(missing_ok=True)  # a temporary of a write that never finished
                continue
            try:
                found.append((path.stat().st_mtime, int(path.stem, 16), path.stat().st_size))
            except (ValueError, OSError):
                path.unlink(missing_ok=True)
        for _, h, size in sorted(found):
            self._files[h] = size
            self._used += size
        if found:
            log.info("disk tier %s: %d blocks (%.1f MiB) from an earlier run", self.dir, len(found),
                     self._used / 2**20)
        while self._used > self.max_bytes and self._files:  # the budget may have shrunk since
            self._remove_oldest()

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:x}{SUFFIX}"

    # ---- engine thread ---------------------------------------------------------------------
    def contains(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._files

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._files)

    @property
    def used_blocks(self) -> int:
        with self._lock:
            return len(self._files)

    @property
    def capacity_blocks(self) -> int:
        return self.max_bytes // self.file_bytes

    @property
    def file_bytes(self) -> int:
        return self.block_bytes + 512  # header and framing, about

    def put(self, block_hash: int, tokens: tuple[int, ...], payload: bytes) -> bool:
        """Queue one block for the writer. False (and a QUEUE_FULL fault) when it is behind."""
        try:
            self._queue.put_nowait(DiskWrite(block_hash, tokens, payload))
            return True
        except queue.Full:
            with self._lock:
                self._faults.append(TierFault.QUEUE_FULL)
            return False

    def read(self, block_hash: int, tokens: tuple[int, ...]) -> bytes | None:
        """The block's payload, or None (a miss) when there is no such file or it fails a
        check (then it is deleted and counted as CORRUPT)."""
        with self._lock:
            if block_hash not in self._files:
                return None
            self._files.move_to_end(block_hash)
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
            payload = self._check(data, block_hash, tokens)
        except (OSError, ValueError, msgspec.DecodeError) as e:
            log.warning("disk tier: block file %s is unusable (%s); dropping it", path.name, e)
            self._forget(block_hash, TierFault.CORRUPT)
            return None
        try:
            os.utime(path)  # recency survives a restart
        except OSError:
            pass
        return payload

    def _check(self, data: bytes, block_hash: int, tokens: tuple[int, ...]) -> bytes:
        if data[:len(MAGIC)] != MAGIC:
            raise ValueError("bad magic")
        (n,) = _LEN.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _LEN.size
        header = msgspec.msgpack.decode(data[start:start + n], type=DiskHeader)
        want = self.layout
        if (header.model, header.dtype, tuple(header.block_shape)) != tuple(want):
            raise ValueError(f"layout {header.model}/{header.dtype}/{header.block_shape} is not {tuple(want)}")
        if header.block_hash != block_hash or tuple(header.tokens) != tokens:
            raise ValueError("another block's hash or tokens")
        payload = data[start + n:]
        if len(payload) != header.nbytes or header.nbytes != self.block_bytes:
            raise ValueError(f"{len(payload)} payload bytes, header says {header.nbytes}, "
                             f"a block is {self.block_bytes}")
        if zlib.crc32(payload) != header.crc32:
            raise ValueError("checksum mismatch")
        return payload

    def _forget(self, block_hash: int, fault: TierFault | None) -> None:
        with self._lock:
            size = self._files.pop(block_hash, None)
            if size is not None:
                self._used -= size
                self._dropped.append(block_hash)
            if fault is not None:
                self._faults.append(fault)
        self._path(block_hash).unlink(missing_ok=True)

    def take_dropped(self) -> tuple[list[int], list[TierFault]]:
        """Hashes whose files went away since the last call (evicted for room, failed a write
        or a check) and the faults counted meanwhile."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
            faults, self._faults = self._faults, []
        return dropped, faults

    def clear(self) -> None:
        """Delete every file of this layout (queued writes still land: ``clear`` after ``close``
        for none to)."""
        with self._lock:
            while self._files:
                self._remove_oldest()

    def close(self) -> None:
        """Finish the queued writes and stop the writer."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    # ---- writer thread ---------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            t0 = time.perf_counter()
            try:
                size = self._write(job)
            except OSError as e:  # disk full, read-only, gone: the block is dropped, counted
                log.warning("disk tier: writing block %x failed: %s", job.block_hash, e)
                with self._lock:
                    self._dropped.append(job.block_hash)
                    self._faults.append(TierFault.WRITE_FAILED)
                continue
            with self._lock:
                self.store_s += time.perf_counter() - t0
                self.stored_bytes += size

    def _write(self, job: DiskWrite) -> int:
        header = msgspec.msgpack.encode(DiskHeader(
            model=self.layout.model, dtype=self.layout.dtype, block_shape=list(self.layout.block_shape),
            block_hash=job.block_hash, tokens=list(job.tokens), nbytes=len(job.payload),
            crc32=zlib.crc32(job.payload)))
        size = len(MAGIC) + _LEN.size + len(header) + len(job.payload)
        with self._lock:
            if job.block_hash in self._files:
                self._files.move_to_end(job.block_hash)
                return 0
            while self._used + size > self.max_bytes and self._files:
                self._remove_oldest()
        if size > self.max_bytes:
            raise OSError(f"a block file of {size} bytes exceeds the disk tier's {self.max_bytes}")
        path = self._path(job.block_hash)
        tmp = path.with_suffix(f".tmp{threading.get_ident()}")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(header)) + header)
                f.write(job.payload)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._files[job.block_hash] = size
            self._used += size
        return size

    def _remove_oldest(self) -> None:
        """Under the lock: delete the least recently used file."""
        h, size = self._files.popitem(last=False)
        self._used -= size
        self._dropped.append(h)
        try:
            self._path(h).unlink()
        except OSError:
            pass
