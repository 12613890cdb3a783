"""One block file of the disk tier (engine/kv/disk_tier.py): its name, its bytes and the
checks a read makes before it trusts them.

Owns the format. Must not: keep an index, delete files, or count faults (the tier does,
from the ``BlockFileError`` a read raises).

::

    <block hash, hex>.kvb     one block, all layers, K and V
      b"SPLITKV2" | u32 header length (little-endian) | header (msgpack DiskHeader) | payload | MAC

The header names the model, dtype and one block's shape, the block's hash, tokens and salt
identity (common/hashing.py ``salt_id``). The MAC is HMAC-SHA256 of everything before it
under the node's key (engine/kv/disk_trust.py), so a file is read back only by a node
holding the key that wrote it. A read trusts nothing it has not checked, in this order,
and raises with the fault on the right::

    lstat, open(O_NOFOLLOW | O_NONBLOCK), fstat: a regular file of this user   UNSAFE
    ... of the size the index holds (so a file is never read whole before)     CORRUPT
    magic, header length, header, layout, hash, payload size                   CORRUPT
    the MAC (another key's file, a planted one, a flipped payload byte)        UNAUTHENTICATED

Files of the previous format (``SPLITKV1``: a CRC, no MAC) fail the magic.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat
import struct
from typing import NamedTuple

import msgspec

from ...common.outcomes import TierFault

MAGIC = b"SPLITKV2"  # and the format's version
SUFFIX = ".kvb"
MAC_BYTES = hashlib.sha256().digest_size
MAX_HEADER = 1 << 16  # header bytes at most (a block's tokens, the model's name): a longer one is damage
_LEN = struct.Struct("<I")
_FRAME = len(MAGIC) + _LEN.size + MAC_BYTES  # a file's bytes beside its header and payload
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a fifo never blocks


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
    salt: bytes  # the salt identity of the request that cached the block (common/hashing.py salt_id)
    tokens: list[int]
    nbytes: int


class BlockFileError(Exception):
    """A block file failed a check: the fault it counts, and why (for the log)."""

    def __init__(self, fault: TierFault, why: str):
        super().__init__(why)
        self.fault = fault


def block_file_name(block_hash: int) -> str:
    return f"{block_hash:x}{SUFFIX}"


def block_file_hash(name: str) -> int | None:
    """The block hash the file name ``name`` stands for; None unless it is exactly
    ``block_file_name(hash)`` (one name per hash)."""
    stem = name.removesuffix(SUFFIX)
    if stem == name or not 0 < len(stem) <= 16 or stem.strip("0123456789abcdef"):
        return None
    h = int(stem, 16)
    return h if block_file_name(h) == name else None


def plausible_size(size: int, block_bytes: int) -> bool:
    """Whether a file of ``size`` bytes may hold one block of ``block_bytes``."""
    return block_bytes + _FRAME < size <= block_bytes + _FRAME + MAX_HEADER


def encode_block(header: DiskHeader, payload: bytes, key: bytes) -> tuple[bytes, bytes]:
    """A block file's bytes: (what precedes the payload, what follows it: the MAC). Raises
    ValueError for a header over ``MAX_HEADER``."""
    raw = msgspec.msgpack.encode(header)
    if len(raw) > MAX_HEADER:
        raise ValueError(f"a header of {len(raw)} bytes (at most {MAX_HEADER})")
    head = MAGIC + _LEN.pack(len(raw)) + raw
    mac = hmac.new(key, head, hashlib.sha256)
    mac.update(payload)
    return head, mac.digest()


def read_block_file(path: os.PathLike | str, size: int) -> bytearray:
    """The bytes of the block file at ``path``, which the index says holds ``size`` bytes:
    read only once it proved a regular file of this user of that size (a symlink is not
    followed, a fifo not waited on). Raises BlockFileError."""
    try:
        st = os.lstat(path)
        _check_stat(st, size)
        fd = os.open(path, _READ)
    except OSError as e:
        raise BlockFileError(TierFault.UNSAFE if e.errno == errno.ELOOP else TierFault.CORRUPT, str(e)) from None
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise BlockFileError(TierFault.UNSAFE, "replaced while it was opened")
        _check_stat(opened, size)
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise BlockFileError(TierFault.CORRUPT, f"{got} bytes, not the {size} it had")
            got += n
        return data
    except OSError as e:
        raise BlockFileError(TierFault.CORRUPT, str(e)) from None
    finally:
        os.close(fd)


def _check_stat(st: os.stat_result, size: int) -> None:
    """Raise unless ``st`` is a regular file of this user of ``size`` bytes."""
    if not stat.S_ISREG(st.st_mode):
        raise BlockFileError(TierFault.UNSAFE, "not a regular file")
    if st.st_uid != os.geteuid():
        raise BlockFileError(TierFault.UNSAFE, f"owned by uid {st.st_uid}, not this node's user")
    if st.st_size != size:
        raise BlockFileError(TierFault.CORRUPT, f"{st.st_size} bytes, not the {size} it had")


def parse_block(data: bytearray, layout: DiskLayout, block_bytes: int, block_hash: int,
                key: bytes) -> tuple[DiskHeader, memoryview]:
    """The header and payload (a view of ``data``) of block ``block_hash``'s file bytes,
    checked (see the module docstring). Raises BlockFileError."""
    view = memoryview(data)
    if len(view) < _FRAME or view[:len(MAGIC)] != MAGIC:
        raise BlockFileError(TierFault.CORRUPT, "not a block file of this format")
    (n,) = _LEN.unpack_from(view, len(MAGIC))
    start, end = len(MAGIC) + _LEN.size, len(view) - MAC_BYTES
    if n > min(MAX_HEADER, end - start):
        raise BlockFileError(TierFault.CORRUPT, f"a header of {n} bytes in a file of {len(view)}")
    try:
        header = msgspec.msgpack.decode(view[start:start + n], type=DiskHeader)
    except msgspec.DecodeError as e:  # a ValidationError too
        raise BlockFileError(TierFault.CORRUPT, f"header: {e}") from None
    if (header.model, header.dtype, tuple(header.block_shape)) != tuple(layout):
        raise BlockFileError(TierFault.CORRUPT, f"layout {header.model}/{header.dtype}/{header.block_shape} "
                                                f"is not {tuple(layout)}")
    if header.block_hash != block_hash:
        raise BlockFileError(TierFault.CORRUPT, f"it holds block {header.block_hash:x}")
    payload = view[start + n:end]
    if len(payload) != header.nbytes or header.nbytes != block_bytes:
        raise BlockFileError(TierFault.CORRUPT, f"{len(payload)} payload bytes, header says {header.nbytes}, "
                                                f"a block is {block_bytes}")
    if not hmac.compare_digest(hmac.new(key, view[:end], hashlib.sha256).digest(), view[end:]):
        raise BlockFileError(TierFault.UNAUTHENTICATED, "its MAC does not verify under this node's key "
                                                        "(another key's file, a planted one, or damaged)")
    return header, payload
