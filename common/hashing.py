"""The one chained block hash shared by the router, prefill nodes and decode nodes
(the engine's prefix cache included).

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

H is XXH3-64 (the ``xxhash`` package, pinned) of the block's token ids, each as a
u32 little-endian, with the 64-bit seed ``salt(extra_keys) XOR parent`` (``parent``
= ``ROOT_PARENT`` for a first block); the digest is read as an unsigned int::

    salt(extra_keys) = XXH3-64(encode_extra_keys(extra_keys), seed=BLOCK_HASH_SEED)
    BLOCK_HASH_SEED  = XXH3-64(b"splitserve.block_hash.v2", seed=0)
    ROOT_PARENT      = XXH3-64(b"splitserve.block_hash.root", seed=BLOCK_HASH_SEED)

One XXH3 call per block (the salt is computed once per sequence): hashing a
100k-token prompt costs ~2 ms of Python on one core (blake2b with a packed header
cost ~3x that).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterator, Sequence

from xxhash import xxh3_64_intdigest

BLOCK_HASH_VERSION = 2
# Fixed for a version; every process derives the same value. Never randomize.
BLOCK_HASH_SEED: int = xxh3_64_intdigest(b"splitserve.block_hash.v%d" % BLOCK_HASH_VERSION, seed=0)
ROOT_PARENT: int = xxh3_64_intdigest(b"splitserve.block_hash.root", seed=BLOCK_HASH_SEED)

_U64_MAX = (1 << 64) - 1
_U32 = struct.Struct("<I")
assert array("I").itemsize == 4, "array('I') must be 32-bit for the token encoding"


def encode_extra_keys(extra_keys: Sequence[str | int]) -> bytes:
    """Unambiguous bytes for ``extra_keys`` (model id, LoRA name, ...): u32 count,
    then per key ``b"s" | b"i"``, u32 byte length, bytes (str as UTF-8, int as its
    decimal ASCII form).

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


def chain_salt(extra_keys: Sequence[str | int] = ()) -> int:
    """The per-sequence salt of ``extra_keys`` (one XXH3 call; reuse it per prompt)."""
    return xxh3_64_intdigest(encode_extra_keys(extra_keys), seed=BLOCK_HASH_SEED)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` as u32 little-endian. Raises OverflowError for an id outside
    [0, 2**32)."""
    arr = array("I", token_ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def block_hash(
    parent: int | None, token_ids: Sequence[int], extra_keys: Sequence[str | int] = ()
) -> int:
    """The 64-bit unsigned hash of one block.

    ``parent`` is the previous block's hash, or None for the first block of a
    sequence. ``token_ids`` are this block's tokens only. The value is the same in
    every process, on every machine, for a given ``BLOCK_HASH_VERSION``.
    """
    if parent is None:
        parent = ROOT_PARENT
    assert 0 <= parent <= _U64_MAX, f"parent hash {parent} is not a u64"
    return xxh3_64_intdigest(token_bytes(token_ids), seed=chain_salt(extra_keys) ^ parent)


def iter_hash_chunks(
    token_ids: Sequence[int] | bytes,
    block_size: int,
    extra_keys: Sequence[str | int] = (),
    parent: int | None = None,
    chunk_blocks: int = 64,
) -> Iterator[list[int]]:
    """Lazily, the chained hashes of the full blocks of ``token_ids`` (a sequence, or
    its ``token_bytes``), ``chunk_blocks`` at a time (the last list may be shorter):
    a caller that stops early (the router, at the first block no node holds) pays
    only for the chunks it read, encoding included."""
    assert block_size > 0 and chunk_blocks > 0, f"bad block_size {block_size} / chunk {chunk_blocks}"
    salt = chain_salt(extra_keys)
    h = ROOT_PARENT if parent is None else parent
    step = block_size * 4
    full = (len(token_ids) // step if isinstance(token_ids, bytes)
            else len(token_ids) // block_size) * block_size  # tokens in full blocks
    per_chunk = chunk_blocks * block_size
    for a in range(0, full, per_chunk):
        b = min(a + per_chunk, full)
        data = token_ids[a * 4 : b * 4] if isinstance(token_ids, bytes) else token_bytes(token_ids[a:b])
        out = []
        for start in range(0, len(data), step):
            h = xxh3_64_intdigest(data[start : start + step], salt ^ h)  # positional: faster
            out.append(h)
        yield out


def iter_block_hashes(
    token_ids: Sequence[int] | bytes,
    block_size: int,
    extra_keys: Sequence[str | int] = (),
    parent: int | None = None,
) -> Iterator[int]:
    """Lazily, the chained hashes of the full blocks of ``token_ids``, one by one."""
    for chunk in iter_hash_chunks(token_ids, block_size, extra_keys, parent):
        yield from chunk


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
    return list(iter_block_hashes(token_ids, block_size, extra_keys, parent))


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
    parent = hashes[-1] if hashes else None
    hashes.extend(iter_block_hashes(token_ids[done * block_size : num_full * block_size],
                                    block_size, extra_keys, parent))
