"""The one block hash: stable across processes, chained, versioned; and the
prefix-cache event wire types."""

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from splitserve.common.hashing import (
    BLOCK_HASH_SEED,
    BLOCK_HASH_VERSION,
    block_hash,
    encode_extra_keys,
    extend_block_hashes,
    hash_blocks,
    hash_blocks_array,
    token_bytes,
    unfmix64,
)
from splitserve.common.prompt_ref import PromptKeys

# Pinned: if one of these changes, the seed or the encoding changed, and every
# router/node pair of mixed versions loses its cache hits. Bump BLOCK_HASH_VERSION.
PINNED_SEED = 2717527316070887491  # BLOCK_HASH_SEED of version 3
PINNED_ROOT = 351461598175159644  # block_hash(None, [1, 2, 3, 4])
PINNED_CHAIN = [9854631452214498175, 3967511689728129978]  # hash_blocks(range(10), 4, ("m",))

_CHILD_CODE = (
    "from splitserve.common.hashing import block_hash, hash_blocks;"
    "print(block_hash(None, [1, 2, 3, 4]));"
    "print(block_hash(123456789, [7] * 16, ('llama-3-8b', 2)));"
    "print(*hash_blocks(list(range(100)), 16, ('m',)))"
)


def _in_process_values() -> list[str]:
    return [
        str(block_hash(None, [1, 2, 3, 4])),
        str(block_hash(123456789, [7] * 16, ("llama-3-8b", 2))),
        " ".join(map(str, hash_blocks(list(range(100)), 16, ("m",)))),
    ]


def test_pinned_values():
    assert BLOCK_HASH_VERSION == 3
    assert BLOCK_HASH_SEED == PINNED_SEED
    assert block_hash(None, [1, 2, 3, 4]) == PINNED_ROOT
    assert hash_blocks(list(range(10)), 4, ("m",)) == PINNED_CHAIN


def _fmix(x):
    """MurmurHash3's 64-bit finalizer, as the hashing module docstring names it (fmix64)."""
    mask = 2**64 - 1
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & mask
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & mask
    return x ^ (x >> 33)


def _reference_chain(tokens, block_size, extra_keys=(), parent=None):
    """The hashing module docstring's formula, one block at a time in Python ints,
    from xxhash and the documented constants alone."""
    mask = 2**64 - 1

    def splitmix(x):
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    seed = xxhash.xxh3_64_intdigest(b"splitserve.block_hash.v3", seed=0)
    words = (block_size + 3) // 4 * 2
    keys = [splitmix((seed + (block_size << 32) + k) & mask) for k in range(words)]
    mult = splitmix(seed ^ 0x6D756C74) | 1
    state = splitmix(seed ^ 0x726F6F74)
    if parent is not None:  # the parent hash is fmix(state): undo it
        state = unfmix64(parent)
        assert _fmix(state) == parent
    salt = xxhash.xxh3_64_intdigest(encode_extra_keys(extra_keys), seed=seed)
    out = []
    for j in range(len(tokens) // block_size):
        ids = list(tokens[j * block_size:(j + 1) * block_size]) + [0] * (2 * words - block_size)
        x = [ids[2 * i] | ids[2 * i + 1] << 32 for i in range(words)]  # u64 LE words of u32 LE ids
        v = sum((x[2 * k] + keys[2 * k]) * (x[2 * k + 1] + keys[2 * k + 1]) for k in range(words // 2)) & mask
        state = (state * mult + _fmix(v ^ salt)) & mask
        out.append(_fmix(state))
    return out


@pytest.mark.parametrize("block_size", [1, 3, 4, 6, 16])
def test_encoding_matches_documented_layout(block_size):
    rng = random.Random(block_size)
    tokens = [5, 70000, 0, 2**32 - 1] + [rng.randrange(2**32) for _ in range(block_size * 5000)]
    extra = ("model", 42)
    assert hash_blocks(tokens, block_size, extra) == _reference_chain(tokens, block_size, extra)
    # Segments of SEGMENT_BLOCKS chain on exactly; so does parent=.
    hashes = hash_blocks(tokens, block_size, extra)
    cut = 4097
    assert hash_blocks(tokens[cut * block_size:], block_size, extra, parent=hashes[cut - 1]) == hashes[cut:]
    assert _reference_chain(tokens[:8 * block_size], block_size, extra, parent=2**64 - 1) == hash_blocks(
        tokens[:8 * block_size], block_size, extra, parent=2**64 - 1)
    # bytes, numpy arrays and lists give the same chain
    assert hash_blocks(token_bytes(tokens), block_size, extra) == hashes
    assert hash_blocks_array(np.array(tokens, dtype=np.int64), block_size, extra).tolist() == hashes
    with pytest.raises(OverflowError):
        block_hash(None, [2**32])
    with pytest.raises(OverflowError):
        block_hash(None, [-1])
    with pytest.raises(OverflowError):
        hash_blocks(np.array([2**32], dtype=np.int64), 1)


def test_fmix_inverse():
    for x in (0, 1, 2**63, 2**64 - 1, 0x123456789ABCDEF):
        assert unfmix64(_fmix(x)) == x


@pytest.mark.parametrize("seed", ["0", "1", "12345", "random"])
def test_same_hash_in_processes_with_different_hashseed(seed):
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD_CODE], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == _in_process_values()


def test_value_range_and_determinism():
    h = block_hash(None, list(range(16)))
    assert 0 <= h < 2**64
    assert h == block_hash(None, tuple(range(16)))  # sequence type does not matter


def test_chaining_and_extra_keys():
    tokens = list(range(16))
    root = block_hash(None, tokens)
    assert block_hash(1, tokens) != root
    assert block_hash(1, tokens) != block_hash(2, tokens)
    assert block_hash(0, tokens) != root  # parent 0 is not the root marker
    assert block_hash(None, tokens, ("model-a",)) != root
    assert block_hash(None, tokens, ("model-a",)) != block_hash(None, tokens, ("model-b",))
    # Unambiguous: key boundaries and key types are part of the encoding.
    assert block_hash(None, tokens, ("ab", "c")) != block_hash(None, tokens, ("a", "bc"))
    assert block_hash(None, tokens, ("1",)) != block_hash(None, tokens, (1,))
    # Token width is fixed: [1, 0] is not [256] or [1].
    assert block_hash(None, [1, 0]) != block_hash(None, [256])
    assert block_hash(None, [1, 0]) != block_hash(None, [1])
    with pytest.raises(TypeError):
        block_hash(None, tokens, (1.5,))  # type: ignore[arg-type]


def test_hash_blocks_chains_full_blocks_only():
    tokens = list(range(37))
    hashes = hash_blocks(tokens, 8, ("m",))
    assert len(hashes) == 4  # 37 // 8; the partial block t32..t36 has none
    parent = None
    for i, h in enumerate(hashes):
        assert h == block_hash(parent, tokens[i * 8 : (i + 1) * 8], ("m",))
        parent = h
    assert hash_blocks(tokens[:7], 8) == []
    assert hash_blocks(tokens[:32], 8, ("m",)) == hashes
    # Same block tokens at another position (other parent) hash differently.
    rep = [9] * 16
    a, b = hash_blocks(rep, 8)
    assert a != b
    # parent= continues a chain.
    assert hash_blocks(tokens[16:32], 8, ("m",), parent=hashes[1]) == hashes[2:4]


def test_extend_block_hashes_matches_hash_blocks():
    tokens = list(range(1000, 1050))
    hashes: list[int] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(hashes, tokens[:n], 6, ("m", 3))
        assert hashes == hash_blocks(tokens[:n], 6, ("m", 3))
    before = list(hashes)
    extend_block_hashes(hashes, tokens, 6, ("m", 3))  # nothing new full: unchanged
    assert hashes == before
    # Jumping several blocks at once.
    jumped = hash_blocks(tokens[:12], 6)
    extend_block_hashes(jumped, tokens, 6)
    assert jumped == hash_blocks(tokens, 6)




def test_cache_salt_keys_separate_every_block_and_leave_unsalted_hashes_alone():
    def hash_keys(model: str, cache_salt: str | None = None) -> tuple:
        return PromptKeys(model=model, cache_salt=cache_salt).hash_keys()

    tokens = list(range(2000, 2000 + 6 * 16 + 3))
    plain = hash_blocks(tokens, 16, hash_keys("m"))
    assert hash_keys("m") == ("m",) and plain == hash_blocks(tokens, 16, ("m",))  # unchanged by salts
    a = hash_blocks(tokens, 16, hash_keys("m", "tenant-a"))
    b = hash_blocks(tokens, 16, hash_keys("m", "tenant-b"))
    assert len(a) == len(b) == len(plain) == 6
    # No block of one salt shares a hash with any block of another (or of the unsalted chain).
    assert not set(a) & set(b) and not set(a) & set(plain) and not set(b) & set(plain)
    assert a == hash_blocks(tokens, 16, hash_keys("m", "tenant-a"))  # deterministic
    # The salt is labelled among the keys: it cannot be confused with a second model key.
    assert hash_keys("m", "x") != ("m", "x") and hash_blocks(tokens, 16, ("m", "x")) != hash_blocks(
        tokens, 16, hash_keys("m", "x"))
    # A chain continues under its salt exactly as if hashed at once (decode steps, adoption).
    grown: list[int] = []
    for n in range(0, len(tokens) + 1, 7):
        extend_block_hashes(grown, tokens[:n], 16, hash_keys("m", "tenant-a"))
    extend_block_hashes(grown, tokens, 16, hash_keys("m", "tenant-a"))
    assert grown == a
    assert hash_blocks(tokens[48:96], 16, hash_keys("m", "tenant-a"), parent=a[2]) == a[3:6]
