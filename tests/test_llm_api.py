"""The offline API: prompt kinds, stop strings, seeds, logprobs, validation."""

import math

import pytest

from splitserve.common.errors import InvalidRequest
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.llm import LLM


@pytest.fixture(scope="module")
def llm(bundled_dir):
    return LLM(model=str(bundled_dir), kv_cache_memory=64 << 20)


def test_text_chat_and_token_prompts(llm, tokenizer):
    p = SamplingParams(temperature=0, max_tokens=12)
    text, chat, ids = llm.generate(["The capital of France is",
                                    [{"role": "user", "content": "What is 2+2?"}],
                                    tokenizer("The capital of France is")["input_ids"]], p)
    assert text.token_ids == ids.token_ids and text.text == ids.text
    assert text.text == tokenizer.decode(text.token_ids, skip_special_tokens=True)
    assert "4" in chat.text
    assert [o.finish_reason for o in (text, chat)] == ["length" if len(text.token_ids) == 12 else "stop", "stop"]


def test_stop_string_truncates_and_finishes(llm):
    full = llm.generate("Count: one, two, three, four, five,", SamplingParams(temperature=0, max_tokens=20))[0]
    assert "," in full.text
    stop = full.text[full.text.index(","):][:2]  # a string that appears in the greedy output
    out = llm.generate("Count: one, two, three, four, five,", SamplingParams(temperature=0, max_tokens=20,
                                                                            stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    assert stop not in out.text


def test_same_seed_same_output_different_seed_differs(llm):
    p = lambda seed: SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=seed, ignore_eos=True)
    a = llm.generate(["Tell me a story.", "Tell me a story."], [p(7), p(8)])
    b = llm.generate(["Unrelated prompt in the batch", "Tell me a story."], [p(1), p(7)])
    assert a[0].token_ids == b[1].token_ids
    assert a[0].token_ids != a[1].token_ids


def test_logprobs_are_log_softmax_of_the_model(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, logprobs=3))[0]
    assert len(out.logprobs) == 3
    for lp, tok in zip(out.logprobs, out.token_ids):
        assert lp.token_id == tok and lp.logprob <= 0
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert sum(math.exp(v) for _, v in lp.top) <= 1.0 + 1e-5


def test_penalties_change_greedy_output(llm):
    prompt = "Repeat after me: banana banana banana banana"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    pen = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                              repetition_penalty=1.8, frequency_penalty=1.5))[0]
    assert base.token_ids != pen.token_ids


@pytest.mark.parametrize("prompt, params, field", [
    ("", SamplingParams(), "prompt"),
    ([], SamplingParams(), "prompt"),
    ("hi", SamplingParams(max_tokens=0), "max_tokens"),
    ("hi", SamplingParams(temperature=-1), "temperature"),
    ("hi", SamplingParams(top_p=0), "top_p"),
    ("hi", SamplingParams(top_p=1.01), "top_p"),
    ("word " * 9000, SamplingParams(), "prompt"),
    ([{"role": "user"}], SamplingParams(), "messages[0]"),
])
def test_bad_input_raises_value_error_naming_field(llm, prompt, params, field):
    with pytest.raises(ValueError) as err:
        llm.generate([prompt], params)
    assert isinstance(err.value, InvalidRequest) and err.value.field == field
    assert not llm.engine.has_unfinished()
