"""The one block hash: stable across processes, chained, versioned; and the
prefix-cache event wire types."""

import os
import struct
import subprocess
import sys

import pytest
import xxhash

from splitserve.common.hashing import (
                                       BLOCK_HASH_SEED,
                                       BLOCK_HASH_VERSION,
                                       block_hash,
                                       extend_block_hashes,
                                       hash_blocks,
                                       iter_block_hashes,
                                       token_bytes,
                                       )

# Pinned: if one of these changes, the seed or the encoding changed, and every
# router/node pair of mixed versions loses its cache hits. Bump BLOCK_HASH_VERSION.
PINNED_SEED = 14744545482444077501  # BLOCK_HASH_SEED of version 2
PINNED_ROOT = 5150712336806779412  # block_hash(None, [1, 2, 3, 4])
PINNED_CHAIN = [6698018389303806814, 5201479971293227470]  # hash_blocks(range(10), 4, ("m",))

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
    assert BLOCK_HASH_VERSION == 2
    assert BLOCK_HASH_SEED == PINNED_SEED
    assert block_hash(None, [1, 2, 3, 4]) == PINNED_ROOT
    assert hash_blocks(list(range(10)), 4, ("m",)) == PINNED_CHAIN


def test_encoding_matches_documented_layout():
    # Re-derive from the layout in the hashing module docstring with xxhash alone.
    tokens = [5, 70000, 0, 2**32 - 1]
    parent = 2**64 - 1
    seed = xxhash.xxh3_64_intdigest(b"splitserve.block_hash.v2", seed=0)
    assert BLOCK_HASH_SEED == seed
    extra = (struct.pack("<I", 2) + b"s" + struct.pack("<I", 5) + b"model"
             + b"i" + struct.pack("<I", 2) + b"42")
    salt = xxhash.xxh3_64_intdigest(extra, seed=seed)
    data = struct.pack("<4I", *tokens)
    assert block_hash(parent, tokens, ("model", 42)) == xxhash.xxh3_64_intdigest(data, seed=salt ^ parent)
    root = xxhash.xxh3_64_intdigest(b"splitserve.block_hash.root", seed=seed)
    assert block_hash(None, tokens, ("model", 42)) == xxhash.xxh3_64_intdigest(data, seed=salt ^ root)
    with pytest.raises(OverflowError):
        block_hash(None, [2**32])
    with pytest.raises(OverflowError):
        block_hash(None, [-1])


def test_iter_block_hashes_is_lazy_and_equal():
    tokens = list(range(64))
    it = iter_block_hashes(tokens, 16, ("m",))
    assert next(it) == hash_blocks(tokens, 16, ("m",))[0]
    assert list(iter_block_hashes(token_bytes(tokens), 16, ("m",))) == hash_blocks(tokens, 16, ("m",))


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


