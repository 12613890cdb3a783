"""router/prompt.py: a prompt's id list is validated and read once; the array, the
wire bytes and a migrated continuation all describe the same ids."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.common.errors import InvalidRequest
from splitserve.common.hashing import hash_blocks
from splitserve.common.prompt_ref import prompt_ids
from splitserve.router.prompt import Prompt

VOCAB = 1000


@given(st.lists(st.integers(0, VOCAB - 1), max_size=300), st.lists(st.integers(0, VOCAB - 1), max_size=20))
def test_array_wire_and_extension_match_the_ids(ids, more):
    p = Prompt.of(ids, VOCAB)
    assert p.array.dtype == np.uint32 and p.array.tolist() == ids and len(p) == len(ids)
    assert prompt_ids(p.wire()) == ids  # what the decode node reads
    q = p.extended(more)
    assert q.ids == ids + more and q.array.tolist() == ids + more
    assert p.ids == ids  # the original is untouched
    assert hash_blocks(q.array, 16, ("m",)) == hash_blocks(ids + more, 16, ("m",))


@pytest.mark.parametrize("bad", [-1, VOCAB, 2**32, 2**40, -(2**63)])
def test_an_id_outside_the_vocabulary_is_named(bad):
    with pytest.raises(InvalidRequest) as e:
        Prompt.of([1, 2, bad, 3], VOCAB, "prompt")
    assert e.value.field == "prompt" and f"token id {bad} " in e.value.message


def test_the_array_is_read_only():
    p = Prompt.of([1, 2, 3], VOCAB)
    with pytest.raises(ValueError):
        p.array[0] = 7


def test_a_salted_prompt_keeps_its_salt_through_a_migration():
    """A migrated continuation (`extended`) stays in its tenant's cache: same salt, and the
    router's hashes of it are the salted ones every node computes."""
    from splitserve.common.prompt_ref import PromptKeys
    from splitserve.router.api_keys import effective_cache_salt

    salt = effective_cache_salt("tenant-a", "x")
    p = Prompt.of(list(range(40)), 1000).salted(salt)
    assert p.cache_salt == salt and p.salted(salt) is p and p.salted(None).cache_salt is None
    moved = p.extended([7] * 30)
    assert moved.cache_salt == salt and moved.ids == list(range(40)) + [7] * 30
    assert moved.ref("m", 16).block_hashes().tolist() == hash_blocks(
        moved.ids, 16, PromptKeys(model="m", cache_salt=salt).hash_keys()) != hash_blocks(moved.ids, 16, ("m",))
