"""Hash once, carry it: the router's `PromptHashes` are adopted by a node only when
they are this prompt's hashes for the node's version, block size and model key."""

import msgspec
import numpy as np
import pytest

from splitserve.common.errors import InvalidRequest
from splitserve.common.hashing import hash_blocks, hash_blocks_array, token_bytes
from splitserve.common.prompt_ref import PromptHashes, PromptKeys, PromptRef, WirePrompt, prompt_ids
from splitserve.common.protocol import GenerateRequest
from splitserve.common.sampling_params import SamplingParams

BS = 16
MODEL = "m"


def keys(model=MODEL, cache_salt=None) -> PromptKeys:
    return PromptKeys(model=model, cache_salt=cache_salt)


def carried(tokens, block_size=BS, model=MODEL) -> PromptHashes:
    return PromptHashes.of(hash_blocks_array(tokens, block_size, (model,)), block_size)


def adopted(c: PromptHashes, tokens, block_size=BS, model=MODEL, cache_salt=None) -> list[int] | None:
    hashes = c.adopt(tokens, block_size, keys(model, cache_salt))
    return None if hashes is None else hashes.tolist()


def test_adopted_when_they_match_and_survive_the_wire():
    tokens = list(range(1000, 1000 + 10 * BS + 5))
    req = GenerateRequest(request_id="r", prompt=WirePrompt(token_ids=token_bytes(tokens), keys=keys(),
                                                            hashes=carried(tokens)), sampling_params=SamplingParams())
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=GenerateRequest)
    assert adopted(back.prompt.hashes, tokens) == hash_blocks(tokens, BS, (MODEL,))
    assert prompt_ids(back.prompt.token_ids) == tokens  # the prompt travels as u32 bytes
    ref = PromptRef.from_wire(back.prompt, MODEL, BS)  # as a node reads it
    assert ref.adopted and ref.token_ids == tokens and ref.block_hashes().tolist() == hash_blocks(tokens, BS, (MODEL,))
    with pytest.raises(InvalidRequest, match="u32"):
        prompt_ids(token_bytes(tokens)[:-1])
    assert adopted(carried(tokens[:BS - 1]), tokens[:BS - 1]) == []  # no full block


def test_refused_for_another_block_size_model_version_or_prompt():
    tokens = list(range(500, 500 + 8 * BS))
    c = carried(tokens)
    assert adopted(c, tokens, 32) is None  # the node's block size differs
    assert adopted(c, tokens, BS, "other-model") is None
    assert adopted(msgspec.structs.replace(c, version=c.version - 1), tokens) is None
    assert adopted(c, tokens[:-BS]) is None  # count does not fit the prompt
    shifted = [t + 1 for t in tokens]
    assert adopted(c, shifted) is None  # first block re-hashes differently
    tail = tokens[:-1] + [7]
    assert adopted(c, tail) is None  # last block re-hashes differently
    wrong = np.frombuffer(c.hashes, dtype="<u8").copy()
    wrong[0] ^= 1
    assert adopted(msgspec.structs.replace(c, hashes=wrong.tobytes()), tokens) is None
    # a node of another model re-hashes with its own model key, whatever the sender named
    other = PromptRef.from_wire(WirePrompt(token_ids=token_bytes(tokens), keys=keys(), hashes=c), "other-model", BS)
    assert not other.adopted and other.keys.model == "other-model"
    assert other.block_hashes().tolist() == hash_blocks(tokens, BS, ("other-model",))


def test_adopted_only_under_the_salt_they_were_made_with():
    """A node re-hashes the first and last blocks with the request's cache salt: hashes the
    router made under another salt (or none) are refused, so the engine hashes them itself."""
    tokens = list(range(700, 700 + 5 * BS + 3))
    salted = PromptHashes.of(hash_blocks_array(tokens, BS, keys(cache_salt="s1").hash_keys()), BS)
    assert adopted(salted, tokens, cache_salt="s1") == hash_blocks(tokens, BS, keys(cache_salt="s1").hash_keys())
    assert adopted(salted, tokens, cache_salt="s2") is None
    assert adopted(salted, tokens) is None
    assert adopted(carried(tokens), tokens, cache_salt="s1") is None  # unsalted hashes, salted request
    one = tokens[:BS]  # a single block: the first-block check alone decides
    assert adopted(PromptHashes.of(hash_blocks_array(one, BS, keys(cache_salt="s1").hash_keys()), BS), one,
                   cache_salt="s2") is None
    req = GenerateRequest(request_id="r", prompt=WirePrompt(token_ids=token_bytes(tokens), keys=keys(cache_salt="s1"),
                                                            hashes=salted), sampling_params=SamplingParams())
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=GenerateRequest)
    assert back.prompt.keys.cache_salt == "s1" and PromptRef.from_wire(back.prompt, MODEL, BS).adopted
    empty = msgspec.msgpack.encode(msgspec.structs.replace(req, prompt=msgspec.structs.replace(
        req.prompt, keys=msgspec.structs.replace(req.prompt.keys, cache_salt=""))))
    with pytest.raises(msgspec.ValidationError, match="cache_salt"):  # a node answers 400 naming it
        msgspec.msgpack.decode(empty, type=GenerateRequest)
