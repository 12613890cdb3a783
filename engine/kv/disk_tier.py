"""The disk tier of a prefix cache: one authenticated file per KV block under a folder
private to the node's user, bounded in bytes, written by one background thread, read on the
engine thread.

Owns the folder's files of this engine's layout, their index (block hash -> its size and,
once known, its tokens and salt identity, least recently used first: a lookup checks a hit
by it without reading the file, ``holds``) and the writer thread. Must not: touch the device
cache or the host tier (engine/kv/tier_store.py hands it a block's bytes and takes bytes back), or raise
into the engine: a bad file, a full disk or a failed write is a miss and a ``TierFault``.

Layout::

    <dir>/kv-disk.key                               the node's MAC key, unless given (disk_trust.py)
    <dir>/<layout digest>/<block hash, hex>.kvb     one block (engine/kv/disk_file.py)

A file names the model, dtype and block layout, so a node restarted with the same ones finds
its files again (the digest of those is the folder; a file is checked against them again
when read) and any other node ignores them; it carries the block's hash, tokens and salt
identity, and a MAC under the node's key (engine/kv/disk_trust.py). A file that fails a
check when read (disk_file.py lists them: not a regular file of this user, not the size
indexed, damaged, its MAC) is a miss: dropped from the index, deleted if it can be, its
fault counted. A sound file of other tokens or another salt under the same hash (a 64-bit
collision) is a plain miss and stays.

Folders are made 0700 and must be private (checked at start-up, disk_trust.py
``private_dir``). A block is written 0600 to a temporary of an unpredictable name
(O_CREAT | O_EXCL | O_NOFOLLOW), then renamed, so a node killed while storing leaves no
half-written block under a block's name. The start-up scan removes temporaries, symlinks,
other users' files and names that are no block's, and skips folders (never entering them).

Threads: ``put`` queues from the engine thread; the writer thread writes, evicts the
least recently used files to stay within ``max_bytes`` and reports what it dropped;
``read``, ``contains``, ``take_dropped`` run on the engine thread. The index is shared
under one lock, and a file is deleted only under it, together with the index entry it
belongs to: a read that fails drops the file only if the index still holds the very entry
it read (``_File``, one per write), so a file the writer evicted or stored again meanwhile
is a plain miss, never a fault, and a file just written for the same hash is never deleted
in place of the one that failed.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

from ...common.outcomes import TierFault
from .disk_file import (MAGIC, SUFFIX, BlockFileError, DiskHeader, DiskLayout, block_file_hash,
                           block_file_name, encode_block, parse_block, plausible_size, read_block_file)
from .disk_trust import private_dir

__all__ = ["MAGIC", "SUFFIX", "DiskLayout", "DiskTier", "DiskWrite"]

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"  # a block file being written: ".tmp-<random hex>"
QUEUE_BLOCKS = 256  # blocks waiting for the writer; beyond it a block is dropped (QUEUE_FULL)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class _File(NamedTuple):
    """One block file in the index: a new object per write, so a read can tell whether the
    entry it read is still the one indexed (compared by identity)."""
    size: int
    # the block's tokens and salt identity, known from its write or a read of its header; None
    # for a file an earlier run left (``holds`` takes it as a candidate until a read says)
    tokens: tuple[int, ...] | None = None
    salt: bytes | None = None


class DiskWrite(NamedTuple):
    block_hash: int
    tokens: tuple[int, ...]
    salt: bytes
    payload: bytes


class DiskTier:
    """Blocks on disk for one engine layout (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, layout: DiskLayout, block_bytes: int, max_bytes: int,
                 key: bytes):
        """``key``: the node's MAC key (disk_trust.py ``disk_key``). Raises ValueError,
        saying what to do, when ``root`` or the layout's folder in it is not private to the
        node's user."""
        assert len(key) >= 16, "a disk tier key of under 16 bytes"
        self.layout = layout
        self.block_bytes = block_bytes
        self.max_bytes = max_bytes
        self._key = key
        private_dir(Path(root))
        self.dir = Path(root) / layout.digest
        private_dir(self.dir, follow=False)
        self._lock = threading.Lock()
        self._files: OrderedDict[int, _File] = OrderedDict()  # hash -> its file, least recently used first
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
        """Index the block files a previous run of this layout left, oldest first; remove
        what is no block file of ours (counting the unsafe and the implausible); skip folders."""
        found = []
        with os.scandir(self.dir) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone meanwhile
                if stat.S_ISDIR(st.st_mode):
                    log.warning("disk tier %s: skipping the folder %s in it (remove it)", self.dir, entry.name)
                    continue
                h = block_file_hash(entry.name)
                if h is not None and stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() \
                        and plausible_size(st.st_size, self.block_bytes):
                    found.append((st.st_mtime, h, st.st_size))
                    continue
                if h is not None:  # not a temporary of a write that never finished: counted
                    regular = stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
                    self._faults.append(TierFault.CORRUPT if regular else TierFault.UNSAFE)
                self._unlink(entry.name)
        for _, h, size in sorted(found):
            self._files[h] = _File(size)
            self._used += size
        if found:
            log.info("disk tier %s: %d blocks (%.1f MiB) from an earlier run", self.dir, len(found),
                     self._used / 2**20)
        while self._used > self.max_bytes and self._files:  # the budget may have shrunk since
            self._remove_oldest()

    # ---- engine thread ---------------------------------------------------------------------
    def contains(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._files

    def holds(self, block_hash: int, tokens: tuple[int, ...], salt: bytes) -> bool:
        """Whether a file of ``block_hash`` may hold these tokens of this salt identity, by the
        index alone (no read): one written for them, or one an earlier run left."""
        with self._lock:
            entry = self._files.get(block_hash)
        return entry is not None and (entry.salt is None or (entry.salt == salt and entry.tokens == tokens))

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._files)

    @property
    def used_blocks(self) -> int:
        with self._lock:
            return len(self._files)

    @property
    def backlog(self) -> int:
        """Blocks queued for the writer (``QUEUE_BLOCKS`` at most: beyond, ``put`` drops)."""
        return self._queue.qsize()

    @property
    def capacity_blocks(self) -> int:
        return self.max_bytes // self.file_bytes

    @property
    def file_bytes(self) -> int:
        return self.block_bytes + 512  # header and framing, about

    def put(self, block_hash: int, tokens: tuple[int, ...], salt: bytes, payload: bytes) -> bool:
        """Queue one block for the writer. False (and a QUEUE_FULL fault) when it is behind."""
        try:
            self._queue.put_nowait(DiskWrite(block_hash, tokens, salt, payload))
            return True
        except queue.Full:
            with self._lock:
                self._faults.append(TierFault.QUEUE_FULL)
            return False

    def read(self, block_hash: int, tokens: tuple[int, ...], salt: bytes) -> memoryview | None:
        """The block's payload (a view of the file's bytes), or None (a miss): no such file,
        a sound file of another block under this hash (it stays), or a file that fails a check
        (dropped and counted: see the module docstring)."""
        with self._lock:
            entry = self._files.get(block_hash)
            if entry is None:
                return None
            self._files.move_to_end(block_hash)
        name = block_file_name(block_hash)
        try:
            data = read_block_file(self.dir / name, entry.size)
            header, payload = parse_block(data, self.layout, self.block_bytes, block_hash, self._key)
        except BlockFileError as e:
            if self._forget(block_hash, entry, e.fault):
                log.warning("disk tier: block file %s is unusable (%s); dropped it", name, e)
            return None
        if header.salt != salt or tuple(header.tokens) != tokens:
            with self._lock:  # another block's (a collision): known now, no lookup takes it again
                if self._files.get(block_hash) is entry:
                    self._files[block_hash] = entry._replace(tokens=tuple(header.tokens), salt=header.salt)
            return None
        try:
            os.utime(self.dir / name, follow_symlinks=False)  # recency survives a restart
        except OSError:
            pass
        return payload

    def _forget(self, block_hash: int, entry: _File, fault: TierFault) -> bool:
        """Drop ``block_hash``'s file, which failed a check as ``entry``, and count ``fault``;
        False (nothing done) when the index no longer holds ``entry``: the writer evicted the
        file or stored the block again while it was read, which explains the failure."""
        with self._lock:
            if self._files.get(block_hash) is not entry:
                return False
            del self._files[block_hash]
            self._used -= entry.size
            self._dropped.append(block_hash)
            self._faults.append(fault)
            self._unlink(block_file_name(block_hash))  # under the lock: the writer cannot store it meanwhile
        return True

    def _unlink(self, name: str) -> None:
        """Delete ``name`` from the folder if it can (a folder put there stays; it is never
        indexed again). A block file's name only under the lock, with its index entry
        (module docstring)."""
        try:
            os.unlink(self.dir / name)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("disk tier: cannot remove %s from %s: %s", name, self.dir, e)

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
        try:
            head, mac = encode_block(DiskHeader(
                model=self.layout.model, dtype=self.layout.dtype, block_shape=list(self.layout.block_shape),
                block_hash=job.block_hash, salt=job.salt, tokens=list(job.tokens), nbytes=len(job.payload)),
                job.payload, self._key)
        except ValueError as e:
            raise OSError(str(e)) from None
        size = len(head) + len(job.payload) + len(mac)
        with self._lock:
            if job.block_hash in self._files:
                self._files.move_to_end(job.block_hash)
                return 0
            while self._used + size > self.max_bytes and self._files:
                self._remove_oldest()
        if size > self.max_bytes:
            raise OSError(f"a block file of {size} bytes exceeds the disk tier's {self.max_bytes}")
        tmp = f"{TMP_PREFIX}{secrets.token_hex(8)}"
        fd = os.open(self.dir / tmp, _CREATE, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(job.payload)
                f.write(mac)
            os.replace(self.dir / tmp, self.dir / block_file_name(job.block_hash))
        except OSError:
            self._unlink(tmp)
            raise
        with self._lock:
            self._files[job.block_hash] = _File(size, job.tokens, job.salt)
            self._used += size
        return size

    def _remove_oldest(self) -> None:
        """Under the lock: delete the least recently used file."""
        h, entry = self._files.popitem(last=False)
        self._used -= entry.size
        self._dropped.append(h)
        self._unlink(block_file_name(h))
