"""The one chained block hash shared by the router, prefill nodes and decode nodes.

Owns: the versioned seed, the byte encoding of a block, and the chaining over a
token sequence. Must not: use Python's ``hash()`` (randomized per process by
PYTHONHASHSEED), depend on the platform's byte order or word size, or import torch.
Changing the seed or the encoding is a wire change: bump ``BLOCK_HASH_VERSION``.

A prompt's blocks are hashed as a chain; each hash covers its parent hash, so equal
hashes mean equal prefixes (up to 64-bit collisions, which the block pool guards
against by comparing tokens)::

    token_ids:  [t0 .. t15][t16 .. t31][t32 .. t47][t48 t49]     block_size = 16
                     |           |           |          \\
    hashes:        h0 -------> h1 -------> h2           (partial block: no hash)
    h0 = H(ROOT, t0..t15,  extra_keys)
    h1 = H(h0,   t16..t31, extra_keys)
    h2 = H(h1,   t32..t47, extra_keys)

Encoding of one block, fed to keyed BLAKE2b (key = ``BLOCK_HASH_SEED``, 8-byte
digest, read as a little-endian unsigned int)::

    parent:     b"\\x00" + 8 zero bytes             (root, no parent)
              | b"\\x01" + parent as u64 little-endian
    tokens:     u32 count, then each token id as u32 little-endian
    extra keys: u32 count, then per key: b"s" | b"i", u32 byte length, bytes
                (str as UTF-8, int as its decimal ASCII form)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BLOCK_HASH_VERSION = 1
# Fixed for a version; every process derives the same bytes. Never randomize.
BLOCK_HASH_SEED: bytes = hashlib.sha256(
    b"splitserve.block_hash.v%d" % BLOCK_HASH_VERSION
).digest()

_U64_MAX = (1 << 64) - 1
_ROOT = b"\x00" + bytes(8)
_U32 = struct.Struct("<I")
_PARENT = struct.Struct("<BQ")


def encode_extra_keys(extra_keys: Sequence[str | int]) -> bytes:
    """Unambiguous bytes for ``extra_keys`` (model id, LoRA name, ...).

    ``("ab", "c")`` and ``("a", "bc")`` encode differently, and so do ``"1"`` and
    ``1``. Raises TypeError for any other key type.
    """
    parts = [_U32.pack(len(extra_keys))]
    for key in extra_keys:
        if isinstance(key, str):
            tag, raw = b"s", key.encode("utf-8")
        elif isinstance(key, int):
            tag, raw = b"i", str(int(key)).encode("ascii")
        else:
            raise TypeError(
                f"extra_keys must be str or int, got {type(key).__name__}: {key!r}"
            )
        parts.append(tag + _U32.pack(len(raw)) + raw)
    return b"".join(parts)


def _hash_encoded(parent: int | None, token_ids: Sequence[int], extra: bytes) -> int:
    """Hash one block whose extra keys are already encoded (see module docstring)."""
    if parent is None:
        head = _ROOT
    else:
        assert 0 <= parent <= _U64_MAX, f"parent hash {parent} is not a u64"
        head = _PARENT.pack(1, parent)
    n = len(token_ids)
    # struct raises struct.error for a token id outside [0, 2**32).
    body = struct.pack(f"<I{n}I", n, *token_ids)
    h = hashlib.blake2b(head, digest_size=8, key=BLOCK_HASH_SEED)
    h.update(body)
    h.update(extra)
    return int.from_bytes(h.digest(), "little")


def block_hash(
    parent: int | None, token_ids: Sequence[int], extra_keys: Sequence[str | int] = ()
) -> int:
    """The 64-bit unsigned hash of one block.

    ``parent`` is the previous block's hash, or None for the first block of a
    sequence. ``token_ids`` are this block's tokens only. The value is the same in
    every process, on every machine, for a given ``BLOCK_HASH_VERSION``.
    """
    return _hash_encoded(parent, token_ids, encode_extra_keys(extra_keys))


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str | int] = (),
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``.

    Returns ``len(token_ids) // block_size`` hashes; a trailing partial block gets
    none. ``parent`` chains the first block onto an earlier sequence (None: root).
    """
    assert block_size > 0, f"block_size must be positive, got {block_size}"
    extra = encode_extra_keys(extra_keys)
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _hash_encoded(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


def extend_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str | int] = (),
) -> None:
    """Append to ``hashes`` the hashes of blocks of ``token_ids`` that became full.

    Contract: ``hashes`` are the chained hashes of the first ``len(hashes)`` blocks
    of ``token_ids`` (as ``hash_blocks`` would give them). Afterwards
    ``hashes == hash_blocks(token_ids, block_size, extra_keys)``. Costs one integer
    division when no new block is full (the common decode step).
    """
    num_full = len(token_ids) // block_size
    done = len(hashes)
    if done >= num_full:
        return
    extra = encode_extra_keys(extra_keys)
    parent = hashes[-1] if hashes else None
    for i in range(done, num_full):
        parent = _hash_encoded(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
