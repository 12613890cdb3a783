"""Hash once, carry it: the router's `PromptHashes` are adopted by a node only when
they are this prompt's hashes for the node's version, block size and model key."""

import msgspec
import numpy as np
import pytest

from splitserve.common.errors import InvalidRequest
from splitserve.common.hashing import hash_blocks, hash_blocks_array, hash_keys, token_bytes
from splitserve.common.protocol import GenerateRequest, PromptHashes, prompt_ids
from splitserve.common.sampling_params import SamplingParams

BS = 16
MODEL = "m"


def carried(tokens, block_size=BS, model=MODEL) -> PromptHashes:
    return PromptHashes.of(hash_blocks_array(tokens, block_size, (model,)), block_size, model)


def test_adopted_when_they_match_and_survive_the_wire():
    tokens = list(range(1000, 1000 + 10 * BS + 5))
    req = GenerateRequest(request_id="r", token_ids=token_bytes(tokens), sampling_params=SamplingParams(),
                          prompt_hashes=carried(tokens))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=GenerateRequest)
    assert back.prompt_hashes.adopt(tokens, BS, MODEL) == hash_blocks(tokens, BS, (MODEL,))
    assert prompt_ids(back.token_ids) == tokens  # the prompt travels as u32 bytes
    with pytest.raises(InvalidRequest, match="u32"):
        prompt_ids(token_bytes(tokens)[:-1])
    assert carried(tokens[:BS - 1]).adopt(tokens[:BS - 1], BS, MODEL) == []  # no full block


def test_refused_for_another_block_size_model_version_or_prompt():
    tokens = list(range(500, 500 + 8 * BS))
    c = carried(tokens)
    assert c.adopt(tokens, 32, MODEL) is None  # the node's block size differs
    assert c.adopt(tokens, BS, "other-model") is None
    assert msgspec.structs.replace(c, version=c.version - 1).adopt(tokens, BS, MODEL) is None
    assert c.adopt(tokens[:-BS], BS, MODEL) is None  # count does not fit the prompt
    shifted = [t + 1 for t in tokens]
    assert c.adopt(shifted, BS, MODEL) is None  # first block re-hashes differently
    tail = tokens[:-1] + [7]
    assert c.adopt(tail, BS, MODEL) is None  # last block re-hashes differently
    wrong = np.frombuffer(c.hashes, dtype="<u8").copy()
    wrong[0] ^= 1
    assert msgspec.structs.replace(c, hashes=wrong.tobytes()).adopt(tokens, BS, MODEL) is None


def test_adopted_only_under_the_salt_they_were_made_with():
    """A node re-hashes the first and last blocks with the request's cache salt: hashes the
    router made under another salt (or none) are refused, so the engine hashes them itself."""
    tokens = list(range(700, 700 + 5 * BS + 3))
    salted = PromptHashes.of(hash_blocks_array(tokens, BS, hash_keys(MODEL, "s1")), BS, MODEL)
    assert salted.adopt(tokens, BS, MODEL, "s1") == hash_blocks(tokens, BS, hash_keys(MODEL, "s1"))
    assert salted.adopt(tokens, BS, MODEL, "s2") is None
    assert salted.adopt(tokens, BS, MODEL) is None
    assert carried(tokens).adopt(tokens, BS, MODEL, "s1") is None  # unsalted hashes, salted request
    one = tokens[:BS]  # a single block: the first-block check alone decides
    assert PromptHashes.of(hash_blocks_array(one, BS, hash_keys(MODEL, "s1")), BS, MODEL).adopt(
        one, BS, MODEL, "s2") is None
    req = GenerateRequest(request_id="r", token_ids=token_bytes(tokens), sampling_params=SamplingParams(),
                          prompt_hashes=salted, cache_salt="s1")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=GenerateRequest)
    assert back.cache_salt == "s1" and back.prompt_hashes.adopt(tokens, BS, MODEL, back.cache_salt)
    empty = msgspec.msgpack.encode(msgspec.structs.replace(req, cache_salt=""))
    with pytest.raises(msgspec.ValidationError, match="cache_salt"):  # a node answers 400 naming it
        msgspec.msgpack.decode(empty, type=GenerateRequest)
