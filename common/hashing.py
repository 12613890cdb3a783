"""The one chained block hash shared by the router, prefill nodes and decode nodes
(the engine's prefix cache included).

Owns: the versioned seed, the keys and constants derived from it, the byte encoding
of a block, and the chaining over a token sequence. Must not: use Python's
``hash()`` (randomized per process by PYTHONHASHSEED), depend on the platform's byte
order or word size, or import torch. Changing the seed, a constant or the formula is
a wire change: bump ``BLOCK_HASH_VERSION``.

A prompt's blocks are hashed as a chain; each hash covers every block before it, so
equal hashes mean equal prefixes (up to 64-bit collisions, which the block pool
guards against by comparing tokens)::

    token_ids:  [t0 .. t15][t16 .. t31][t32 .. t47][t48 t49]     block_size = 16
                     |           |           |          \\
    hashes:        h0 -------> h1 -------> h2           (partial block: no hash)

Version 3 is computed for a whole prompt in one pass of numpy array operations (no
Python loop per block: ~0.15 ms for a 100k-token prompt on one core, beside ~0.6 ms
to read a Python list of token ids into an array). All arithmetic is on u64, modulo 2**64::

    w[0..m)       a block's token ids as u32 little-endian, zeros appended up to a
                  multiple of 4 ids, read as m = ceil(B / 4) * 2 u64 little-endian
                  words (B = block_size; for B % 4 == 0 a view, no copy)
    K[0..m)       keys for this block size: splitmix64(BLOCK_HASH_SEED + B * 2**32 + k)
    v_j = sum_k (w[2k] + K[2k]) * (w[2k+1] + K[2k+1])            NH over the block
    g_j = fmix64(v_j ^ salt)        salt = XXH3-64(encode_extra_keys(keys), BLOCK_HASH_SEED)
    S_j = S_{j-1} * MULT + g_j      S_{-1} = ROOT_STATE, or unfmix64(parent hash)
    h_j = fmix64(S_j)               (fmix64: MurmurHash3's 64-bit finalizer, a bijection)

The extra keys of a request's blocks are its ``PromptKeys.hash_keys()``
(common/prompt_ref.py): the served model id, then each further key labelled, such as the
request's cache salt when it has one (vLLM's ``cache_salt``; the router combines an API
key's salt with the request's, router/api_keys.py): ``(model id,)`` or ``(model id,
"cache_salt", salt)``. The keys enter every block's ``g_j`` through ``salt`` above, at no
cost (one XXH3 call per sequence), so two requests with different salts share no block
hash: block 0's states differ, and since ``S_j = MULT**j * S_0 + (terms of blocks 1..j)``
with MULT odd, so does every later one. Salting block 0 alone would already separate the
chains; salting every block keeps one set of keys per sequence, which is what decode steps
extend (``extend_block_hashes``) and what a node's adoption check re-hashes the last block
with (``PromptHashes.adopt``). An unsalted request's keys are ``(model id,)``, as before
the salt existed: same hashes, same version.

Because fmix64 is invertible, a hash is its chain state: a chain continues from any
parent hash (``parent=``), exactly as if the blocks had been hashed together. The
recurrence is computed in closed form, S_i = MULT**i * (MULT * S_{-1} + cumsum_j(g_j *
MULT**-j)), with tables of MULT's powers, ``SEGMENT_BLOCKS`` blocks at a time.

Not a cryptographic hash: prompts crafted to collide (e.g. polynomial-hash attacks)
only cost a cache miss, because a cached block is reused only when its tokens match, and
its salt identity (``salt_id``: a SHA-256 of the extra keys, kept with the block in every
tier), so blocks of two salts are never shared even where their 64-bit hashes collide.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from xxhash import xxh3_64_intdigest

BLOCK_HASH_VERSION = 3
# Fixed for a version; every process derives the same value. Never randomize.
BLOCK_HASH_SEED: int = xxh3_64_intdigest(b"splitserve.block_hash.v%d" % BLOCK_HASH_VERSION, seed=0)

_MASK = (1 << 64) - 1
_U32 = struct.Struct("<I")
assert array("I").itemsize == 4, "array('I') must be 32-bit for the token encoding"
SEGMENT_BLOCKS = 4096  # blocks hashed per vectorised pass (the power tables' length)


def splitmix64(x: int) -> int:
    """SplitMix64's output function of ``x`` (a u64): derives keys and constants."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


MULT: int = splitmix64(BLOCK_HASH_SEED ^ 0x6D756C74) | 1  # odd, so invertible mod 2**64
ROOT_STATE: int = splitmix64(BLOCK_HASH_SEED ^ 0x726F6F74)
_F1, _F2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # fmix64's multipliers
_F1_INV, _F2_INV = pow(_F1, -1, 1 << 64), pow(_F2, -1, 1 << 64)


def _power_table(base: int) -> np.ndarray:
    out = np.empty(SEGMENT_BLOCKS, dtype=np.uint64)  # [i] = base**i mod 2**64
    out[0] = 1
    out[1:] = np.cumprod(np.full(SEGMENT_BLOCKS - 1, base, dtype=np.uint64))
    out.flags.writeable = False
    return out


_POW = _power_table(MULT)
_POW_INV = _power_table(pow(MULT, -1, 1 << 64))


def unfmix64(h: int) -> int:
    """The inverse of fmix64 (``_fmix64_np``): the chain state a block hash stands for."""
    h ^= h >> 33
    h = (h * _F2_INV) & _MASK
    h ^= h >> 33
    h = (h * _F1_INV) & _MASK
    return h ^ (h >> 33)


def _fmix64_np(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(33))
    x *= np.uint64(_F1)
    x ^= x >> np.uint64(33)
    x *= np.uint64(_F2)
    x ^= x >> np.uint64(33)
    return x


def _words(block_size: int) -> int:
    """u64 words of a block: its ids padded to a multiple of 4, two ids a word."""
    return (block_size + 3) // 4 * 2


@lru_cache(maxsize=16)
def _keys(block_size: int) -> np.ndarray:
    """The NH keys of ``block_size``: [words per block] u64, read-only."""
    base = BLOCK_HASH_SEED + (block_size << 32)
    k = np.array([splitmix64((base + i) & _MASK) for i in range(_words(block_size))],
                 dtype=np.uint64)
    k.flags.writeable = False
    return k


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


@lru_cache(maxsize=64)
def chain_salt(extra_keys: tuple = ()) -> int:
    """The per-sequence salt of ``extra_keys`` (one XXH3 call, cached)."""
    return xxh3_64_intdigest(encode_extra_keys(extra_keys), seed=BLOCK_HASH_SEED)


@lru_cache(maxsize=1024)
def salt_id(extra_keys: tuple = ()) -> bytes:
    """The salt identity of a request's blocks: SHA-256 of its extra keys
    (``PromptKeys.hash_keys()``), 32 bytes, the same in every process. Every tier of the
    prefix cache keeps it with a cached block and a hit must match it as well as the tokens
    (a 64-bit hash alone could collide across salts). Not secret: a digest, so a salt never lands on disk in clear."""
    return hashlib.sha256(b"splitserve.salt_id.v1\0" + encode_extra_keys(extra_keys)).digest()


def token_array(token_ids: Sequence[int] | bytes | np.ndarray) -> np.ndarray:
    """``token_ids`` as a u32 numpy array (no copy for bytes or a u32 array). Raises
    OverflowError for an id outside [0, 2**32)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype != np.uint32:
            if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= 1 << 32):
                raise OverflowError("token id outside [0, 2**32)")
            token_ids = token_ids.astype(np.uint32)
        return token_ids
    if isinstance(token_ids, bytes):
        return np.frombuffer(token_ids, dtype="<u4")
    return np.frombuffer(array("I", token_ids), dtype=np.uint32)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` as u32 little-endian. Raises OverflowError for an id outside
    [0, 2**32)."""
    arr = array("I", token_ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def hash_blocks_array(
    token_ids: Sequence[int] | bytes | np.ndarray,
    block_size: int,
    extra_keys: Sequence[str | int] = (),
    parent: int | None = None,
) -> np.ndarray:
    """Chained hashes of the full blocks of ``token_ids`` (a sequence, its
    ``token_bytes``, or an integer numpy array) as a u64 array [len // block_size]."""
    assert block_size > 0, f"bad block_size {block_size}"
    toks = token_array(token_ids)
    n = len(toks) // block_size
    out = np.empty(n, dtype=np.uint64)
    if n == 0:
        return out
    keys = _keys(block_size)
    salt = np.uint64(chain_salt(tuple(extra_keys)))
    state = ROOT_STATE if parent is None else unfmix64(parent)
    assert 0 <= state <= _MASK, f"parent hash {parent} is not a u64"
    m = _words(block_size)
    x = toks[: n * block_size].astype("<u4", copy=False).reshape(n, block_size)  # [n, B] ids
    if block_size % 4:
        x = np.concatenate([x, np.zeros((n, 2 * m - block_size), dtype="<u4")], axis=1)
    words = np.ascontiguousarray(x).view("<u8").astype(np.uint64, copy=False)  # [n, m]
    words = words + keys
    prods = words[:, 0::2] * words[:, 1::2]  # [n, m / 2]
    v = prods[:, 0].copy()  # [n] NH of each block (column adds: faster than a short-axis sum)
    for c in range(1, m // 2):
        v += prods[:, c]
    g = _fmix64_np(v ^ salt)
    for a in range(0, n, SEGMENT_BLOCKS):
        m = min(SEGMENT_BLOCKS, n - a)
        s = np.cumsum(g[a : a + m] * _POW_INV[:m], dtype=np.uint64)
        s += np.uint64((state * MULT) & _MASK)
        s *= _POW[:m]  # S_{a+i} for i < m
        state = int(s[-1])
        out[a : a + m] = s
    return _fmix64_np(out)


def hash_blocks(
    token_ids: Sequence[int] | bytes | np.ndarray,
    block_size: int,
    extra_keys: Sequence[str | int] = (),
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``, as Python ints.

    Returns ``len(token_ids) // block_size`` hashes; a trailing partial block gets
    none. ``parent`` chains the first block onto an earlier sequence (None: root).
    """
    return hash_blocks_array(token_ids, block_size, extra_keys, parent).tolist()


def block_hash(
    parent: int | None, token_ids: Sequence[int], extra_keys: Sequence[str | int] = ()
) -> int:
    """The 64-bit unsigned hash of one block.

    ``parent`` is the previous block's hash, or None for the first block of a
    sequence. ``token_ids`` are this block's tokens only (their count is the block
    size). The value is the same in every process, on every machine, for a given
    ``BLOCK_HASH_VERSION``.
    """
    assert len(token_ids) > 0, "a block has at least one token"
    return hash_blocks(token_ids, len(token_ids), extra_keys, parent)[0]


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
    hashes.extend(hash_blocks(token_ids[done * block_size : num_full * block_size],
                              block_size, extra_keys, parent))
