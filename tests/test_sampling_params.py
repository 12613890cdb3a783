"""SamplingParams validation, the greedy property, and the wire encodings."""

import math

import msgspec
import pytest

from splitserve.common.errors import InvalidRequest
from splitserve.common.sampling_params import SamplingParams, TokenLogprobs


def test_defaults_are_valid_and_validate_returns_self():
    params = SamplingParams()
    assert params.validate() is params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 1.0, 1.0, 0)
    assert params.stop == [] and params.stop_token_ids == [] and params.logprobs is None


def test_mutable_defaults_are_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", True),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_k", False),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_p", math.nan),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("seed", 1.5),
        ("seed", True),
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.5),
        ("presence_penalty", math.inf),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", 3),
        ("frequency_penalty", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.nan),
        ("stop", ["ok", ""]),
        ("stop", [f"s{i}" for i in range(17)]),
        ("stop", ["ok", 3]),
        ("stop", "not a list"),
        ("stop_token_ids", [1, -1]),
        ("stop_token_ids", [1, True]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 5),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("logprobs", 1.0),
        # upper bounds (issue 12)
        ("max_tokens", 2**31),
        # too long to format: the message must still be built
        pytest.param("max_tokens", 10**5000, id="max_tokens-5000-digits"),
        ("temperature", 2.01),
        ("temperature", 1e9),
        ("top_k", 2**31),
        pytest.param("top_k", -(10**5000), id="top_k-5000-digits"),
        pytest.param("seed", 10**5000, id="seed-5000-digits"),
        pytest.param("logprobs", 10**5000, id="logprobs-5000-digits"),
        ("repetition_penalty", 2.5),
        ("stop", ["x" * 513]),
        ("stop_token_ids", [2**31]),
        ("stop_token_ids", list(range(257))),
    ],
)
def test_each_bad_value_names_its_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(InvalidRequest) as info:
        params.validate()
    assert info.value.field == field
    assert isinstance(info.value, ValueError)
    assert info.value.message and field in str(info.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 1),
        ("temperature", 0.0),
        ("temperature", 2.0),
        ("top_p", 1e-9),
        ("top_k", -1),
        ("top_k", 1),
        ("top_k", 100_000),
        ("min_p", 0.0),
        ("min_p", 1.0),
        ("seed", 0),
        ("seed", -(2**63)),
        ("seed", 2**64 - 1),
        ("presence_penalty", -2.0),
        ("frequency_penalty", 2.0),
        ("repetition_penalty", 1e-3),
        ("stop", [f"s{i}" for i in range(16)]),
        ("stop_token_ids", [0, 2]),
        ("ignore_eos", True),
        ("logprobs", 0),
        ("logprobs", 20),
        ("temperature", 2.0),
        ("top_k", 2**31 - 1),
        ("max_tokens", 2**31 - 1),
        ("repetition_penalty", 2.0),
        ("stop", ["x" * 512]),
        ("stop_token_ids", list(range(256))),
    ],
)
def test_boundary_values_are_accepted(field, value):
    SamplingParams(**{field: value}).validate()


def test_messages_state_the_allowed_range():
    with pytest.raises(InvalidRequest, match=r"\(0, 1\]"):
        SamplingParams(top_p=2.0).validate()
    with pytest.raises(InvalidRequest, match=r"\[-2, 2\]"):
        SamplingParams(presence_penalty=9.0).validate()
    with pytest.raises(InvalidRequest, match=r"\[0, 20\]"):
        SamplingParams(logprobs=50).validate()


def test_int_given_for_float_is_converted():
    params = SamplingParams(temperature=1, top_p=1, repetition_penalty=2).validate()
    assert type(params.temperature) is float and params.temperature == 1.0
    assert type(params.repetition_penalty) is float


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-7).greedy  # would overflow logits / T
    assert SamplingParams(temperature=0.8, top_k=1).greedy
    assert not SamplingParams(temperature=0.8).greedy
    assert not SamplingParams(temperature=0.8, top_k=2).greedy
    assert not SamplingParams().greedy


def test_wire_round_trip_omits_defaults():
    assert msgspec.json.encode(SamplingParams()) == b"{}"
    params = SamplingParams(max_tokens=5, temperature=0.0, stop=["\n\n"], seed=7, logprobs=3)
    for codec in (msgspec.json, msgspec.msgpack):
        decoded = codec.decode(codec.encode(params), type=SamplingParams)
        assert decoded == params
    assert msgspec.json.decode(b'{"top_k": 5}', type=SamplingParams).validate().top_k == 5


def test_wire_decoding_rejects_wrong_types():
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"max_tokens": "ten"}', type=SamplingParams)


def test_token_logprobs_is_an_array_on_the_wire():
    lp = TokenLogprobs(token_id=5, logprob=-0.25, top=[(5, -0.25), (9, -1.5)])
    assert msgspec.json.encode(lp) == b"[5,-0.25,[[5,-0.25],[9,-1.5]]]"
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(lp), type=TokenLogprobs) == lp


def test_common_modules_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, splitserve.common.sampling_params, splitserve.common.detokenizer\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
