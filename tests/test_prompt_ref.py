"""common/prompt_ref.py: a prompt's identity. The keys map generically, in order and
labelled, to the extra keys every block hash is made with (today's keys hash exactly as
before: BLOCK_HASH_VERSION unchanged); a new key is one field and changes every hash; a
PromptRef hashes once and shares what it knows with its prefixes, the wire and the engine's
Request."""

import msgspec
import pytest

from splitserve.common.hashing import hash_blocks, salt_id, token_bytes
from splitserve.common.prompt_ref import PromptHashes, PromptKeys, PromptRef, WirePrompt
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.request import Request

BS = 4
PINNED_CHAIN = [9854631452214498175, 3967511689728129978]  # tests/test_hashing.py: hash_blocks(range(10), 4, ("m",))


def test_todays_keys_map_to_todays_hash_keys():
    assert PromptKeys(model="m").hash_keys() == ("m",)
    assert PromptKeys(model="m", cache_salt="s").hash_keys() == ("m", "cache_salt", "s")
    assert PromptRef(list(range(10)), PromptKeys(model="m"), BS).block_hashes().tolist() == PINNED_CHAIN


def test_a_new_key_is_one_field_and_changes_every_block_hash():
    class WithAdapter(PromptKeys, kw_only=True):  # the one edit a new key is (here: a subclass)
        adapter: str | None = None

    tokens = list(range(100, 100 + 5 * BS))
    plain, salted = PromptKeys(model="m"), PromptKeys(model="m", cache_salt="s")
    assert WithAdapter(model="m").hash_keys() == plain.hash_keys()  # unset: hashes as before
    keyed = WithAdapter(model="m", cache_salt="s", adapter="x")
    assert keyed.hash_keys() == ("m", "cache_salt", "s", "adapter", "x")  # in order, labelled
    a = PromptRef(tokens, keyed, BS).block_hashes().tolist()
    assert not set(a) & set(PromptRef(tokens, salted, BS).block_hashes().tolist())
    # the generic slot does the same without a new field, after the named keys
    extra = PromptKeys(model="m", cache_salt="s", extra=(("adapter", "x"),))
    assert extra.hash_keys() == keyed.hash_keys() and PromptRef(tokens, extra, BS).block_hashes().tolist() == a


def test_extra_labels_are_distinct_and_never_a_named_key():
    for extra in ((("cache_salt", "s"),), (("a", 1), ("a", 2)), (("", "x"),), (("model", "m2"),)):
        with pytest.raises(ValueError, match="extra"):
            PromptKeys(model="m", extra=extra)
        raw = msgspec.msgpack.encode({"type": "PromptKeys", "model": "m", "extra": [list(e) for e in extra]})
        with pytest.raises(msgspec.ValidationError, match="extra"):  # a node answers 400
            msgspec.msgpack.decode(raw, type=PromptKeys)
    keys = PromptKeys(model="m", extra=(("lora", "x"), ("draft", 3)))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(keys), type=PromptKeys) == keys
    assert keys.hash_keys() == ("m", "lora", "x", "draft", 3)


def test_hashes_are_computed_once_and_shared_with_prefixes_and_the_wire():
    tokens = list(range(7, 7 + 6 * BS + 1))
    ref = PromptRef(tokens, PromptKeys(model="m", cache_salt="s"), BS)
    assert ref.hashes is None and ref.salt == salt_id(("m", "cache_salt", "s"))
    h = ref.block_hashes()
    assert ref.block_hashes() is h and not h.flags.writeable  # kept: no second hashing
    assert h.tolist() == hash_blocks(tokens, BS, ref.hash_keys)
    head = ref.prefix(3 * BS + 1)
    assert head.hashes is not None and head.hashes.tolist() == h[:3].tolist() and head.keys is ref.keys
    back = PromptRef.from_wire(msgspec.msgpack.decode(msgspec.msgpack.encode(ref.wire()), type=WirePrompt), "m", BS)
    assert back.adopted and back.token_ids == tokens and back.block_hashes().tolist() == h.tolist()
    assert PromptRef.hashed(tokens, ref.keys, BS).hashes.tolist() == h.tolist()


def test_a_node_keeps_the_request_keys_with_its_own_model():
    tokens = list(range(50, 50 + 3 * BS))
    sent = PromptKeys(model="router-name", cache_salt="s", extra=(("adapter", "x"),))
    wire = WirePrompt(token_ids=token_bytes(tokens), keys=sent,
                      hashes=PromptHashes.of(PromptRef.hashed(tokens, sent, BS).block_hashes(), BS))
    ref = PromptRef.from_wire(wire, "node-model", BS)
    assert ref.keys == msgspec.structs.replace(sent, model="node-model") and not ref.adopted  # another model's
    assert ref.hash_keys == ("node-model", "cache_salt", "s", "adapter", "x")
    assert PromptRef.from_wire(WirePrompt.of(tokens), "node-model", BS).keys == PromptKeys(model="node-model")


def test_the_engine_request_takes_its_identity_from_the_ref():
    tokens = list(range(10))
    ref = PromptRef(tokens, PromptKeys(model="m", cache_salt="s"), BS)
    req = Request("r", ref, SamplingParams(max_tokens=8), frozenset())
    assert (req.block_size, req.hash_keys, req.salt) == (BS, ref.hash_keys, ref.salt)
    assert req.block_hashes == ref.block_hashes().tolist() and req.prompt_token_ids == tokens
    req.append_tokens([1, 2], [None, None])  # decoded blocks chain on under the same keys
    assert req.block_hashes == hash_blocks(tokens + [1, 2], BS, ref.hash_keys) and len(ref.block_hashes()) == 2
