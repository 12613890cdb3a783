"""logit_bias, min_tokens and prompt_logprobs in the engine, against transformers on a
tiny random Llama (fp32): greedy decoding with a bias equals transformers' generate
with the same ``sequence_bias``; min_tokens equals its ``min_new_tokens`` (EOS made
likely, so the mask matters); prompt logprobs equal a transformers forward pass, also
when the prompt is computed in several chunks, after a prefix-cache hit would have
been possible, and when a 1-token chunk lands mid-prompt. Plus the masks' own rules
(raw-logit logprobs, stop_token_ids masked, rows without options untouched)."""

from dataclasses import dataclass, field

import pytest
import torch

from splitserve.common.errors import InvalidRequest
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.llm import LLM
from splitserve.engine.sampling.logit_masks import apply_logit_masks
from splitserve.engine.sampling.sampler import Sampler

EOS = 256
PROMPT = [5, 17, 99, 3, 42, 7, 7, 120, 64, 1, 200, 33, 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, transformers model) of a tiny random Llama, built once for the module."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, eos_token_id=EOS, bos_token_id=0,
                                   initializer_range=0.2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_params")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 4 << 20)
    return LLM(str(path), block_size=4, **kwargs)


def hf_generate(model, prompt, n, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=EOS, **kwargs)
    return out[0, len(prompt):].tolist()


def test_logit_bias_matches_transformers_sequence_bias(tiny):
    path, hf = tiny
    llm = make_llm(path)
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    forced = 77
    bias = {forced: 100.0, plain[0]: -100.0}
    got = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, logit_bias=bias))[0]
    assert got.token_ids == [forced] * 8  # +100 wins every step
    want = hf_generate(hf, PROMPT, 8, sequence_bias={(t,): v for t, v in bias.items()})
    assert got.token_ids == want
    # a moderate bias changes some but not all choices: still exactly transformers'
    mild = {plain[1]: -3.0, 11: 2.5}
    got = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, logit_bias=mild))[0]
    assert got.token_ids == hf_generate(hf, PROMPT, 8, sequence_bias={(t,): v for t, v in mild.items()})
    assert got.token_ids != plain


def test_min_tokens_matches_transformers_min_new_tokens(tiny):
    path, hf = tiny
    llm = make_llm(path)
    eager_eos = {EOS: 12.0}  # EOS becomes the greedy choice at once
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, logit_bias=eager_eos))[0]
    assert stopped.token_ids == [EOS] and stopped.finish_reason == "stop"
    got = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, logit_bias=eager_eos,
                                              min_tokens=4))[0]
    want = hf_generate(hf, PROMPT, 10, sequence_bias={(EOS,): 12.0}, min_new_tokens=4)
    assert got.token_ids == want
    assert len(got.token_ids) == 5 and got.token_ids[-1] == EOS and got.finish_reason == "stop"
    assert EOS not in got.token_ids[:4]


def test_min_tokens_masks_stop_token_ids_too(tiny):
    path, _ = tiny
    llm = make_llm(path)
    first = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0))[0].token_ids[0]
    params = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[first], ignore_eos=True)
    assert llm.generate(PROMPT, params)[0].token_ids == [first]
    params.min_tokens = 3
    out = llm.generate(PROMPT, params)[0].token_ids
    assert first not in out[:3] and len(out) >= 3


def hf_prompt_logprobs(model, prompt) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()  # [n, V]
    return torch.log_softmax(logits, dim=-1)[:-1]  # row p predicts prompt[p + 1]


@pytest.mark.parametrize("engine_args", [
    dict(),  # one chunk
    dict(prefill_chunk_size=4, max_num_batched_tokens=4),  # four chunks
    dict(prefill_chunk_size=6, max_num_batched_tokens=6),  # 6 + 6 + 1 (the last token's row samples)
])
def test_prompt_logprobs_match_transformers_forward(tiny, engine_args):
    path, hf = tiny
    llm = make_llm(path, **engine_args)
    ref = hf_prompt_logprobs(hf, PROMPT)  # [n - 1, V]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    lps = out.prompt_logprobs
    assert len(lps) == len(PROMPT) and lps[0] is None
    for p, lp in enumerate(lps[1:]):
        row, token = ref[p], PROMPT[p + 1]
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert lp.rank == int((row > row[token]).sum()) + 1
        top_v, top_i = row.topk(3)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)


@pytest.mark.parametrize("eager", [True, False])
def test_prompt_logprobs_skip_the_prefix_cache_and_survive_a_mid_prompt_one_token_chunk(tiny, eager):
    path, hf = tiny
    ref = hf_prompt_logprobs(hf, PROMPT)
    # a 3-token budget shared with two decoding requests: the prompt runs in 1-token chunks
    # through the decode path (eager, or the padded static decode), mixed with 2- and 3-token chunks
    llm = make_llm(path, prefill_chunk_size=3, max_num_batched_tokens=3, enforce_eager=eager)
    llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0))  # fills the prefix cache
    decoding = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate([[1, 2], [3, 4], PROMPT],
                        [decoding, decoding, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)])
    lps = outs[2].prompt_logprobs
    assert outs[2].num_cached_tokens == 0  # computed, not served from the cache
    assert [lp.logprob for lp in lps[1:]] == pytest.approx(
        [ref[p, PROMPT[p + 1]].item() for p in range(len(PROMPT) - 1)], abs=1e-4)
    assert all(lp.top == [] for lp in lps[1:])


def test_validation_names_the_field(tiny):
    path, _ = tiny
    llm = make_llm(path)
    for params, field_name in [
        (SamplingParams(logit_bias={300: 1.0}), "logit_bias"),  # outside the 257-token vocabulary
        (SamplingParams(logit_bias={1: 101.0}), "logit_bias"),
        (SamplingParams(logit_bias={1: float("nan")}), "logit_bias"),
        (SamplingParams(logit_bias={-1: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (SamplingParams(min_tokens=-1), "min_tokens"),
        (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
        (SamplingParams(include_stop_str_in_output=1), "include_stop_str_in_output"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            llm.generate(PROMPT, params)
        assert e.value.field == field_name


@dataclass(slots=True)
class Req:
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    prompt_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def test_masks_edit_only_the_rows_that_ask_and_logprobs_stay_raw():
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    reqs = [Req(SamplingParams(temperature=0)),
            Req(SamplingParams(temperature=0, logit_bias={2: 5.0, 3: -1.5})),
            Req(SamplingParams(temperature=0, min_tokens=2), output_token_ids=[4], stop_ids=frozenset({1, 9, 50}))]
    out = apply_logit_masks(logits, reqs)
    want = logits.clone()
    want[1, 2] += 5.0
    want[1, 3] -= 1.5
    want[2, 1] = want[2, 9] = float("-inf")
    assert torch.equal(out, want)
    assert apply_logit_masks(logits, [reqs[0]]) is logits  # nothing to do: no copy
    reqs[2].output_token_ids = [4, 4]  # min_tokens reached: no mask
    assert torch.equal(apply_logit_masks(logits, reqs)[2], logits[2])

    reqs[1].sampling_params = SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=1)
    res = Sampler(seed=0)(logits, reqs)
    assert res.token_ids[1] == 7
    assert res.logprobs[1].logprob == pytest.approx(torch.log_softmax(logits[1], -1)[7].item())


def test_min_tokens_gives_way_when_only_a_stop_token_is_left():
    """A complete structured output leaves only EOS (the grammar's mask); min_tokens must
    not mask that too and leave the row with no token at all."""
    logits = torch.full((2, 10), float("-inf"))
    logits[0, 9] = 0.0  # the grammar allows EOS only
    logits[1, [3, 9]] = 0.0  # another row: EOS and one more token
    reqs = [Req(SamplingParams(temperature=0, min_tokens=5), stop_ids=frozenset({9})),
            Req(SamplingParams(temperature=0, min_tokens=5), stop_ids=frozenset({9}))]
    out = apply_logit_masks(logits, reqs)
    assert out[0, 9] == 0.0 and torch.isneginf(out[0, :9]).all()  # EOS kept: the only way on
    assert torch.isneginf(out[1, 9]) and out[1, 3] == 0.0  # masked as usual
