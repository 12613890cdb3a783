"""Sampler: greedy, distributions, filters, seeds, penalties, logprobs (CPU)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.sampling.sampler import Sampler, SamplerOutput, apply_penalties

torch.set_num_threads(1)

# chi-square critical values at p = 0.001, by degrees of freedom
_CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


@dataclass(slots=True)
class Req:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def make_req(prompt=(), output=(), **params) -> Req:
    sp = SamplingParams(**params).validate()
    gen = None
    if sp.seed is not None:
        gen = torch.Generator().manual_seed(sp.seed)
    return Req(sp, list(prompt), list(output), gen)


def chi_square(counts: Counter, probs: list[float], n: int) -> float:
    return sum((counts.get(i, 0) - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)


def draw(sampler: Sampler, logits_row: torch.Tensor, n: int, **params) -> Counter:
    """n independent draws of one row, as one batch of n identical requests."""
    reqs = [make_req(**params) for _ in range(n)]
    out = sampler(logits_row.expand(n, -1).contiguous(), reqs)
    return Counter(out.token_ids)


def test_greedy_is_argmax_with_ties_to_lowest_index():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[2, 7] = logits[2, 30] = 100.0  # tie: must pick 7
    logits[4, :] = 0.0  # all tied: must pick 0
    reqs = [make_req(temperature=0.0) for _ in range(6)]
    out = Sampler(seed=0)(logits, reqs)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[2] == 7 and out.token_ids[4] == 0
    assert out.logprobs == [None] * 6


def test_top_k_one_is_greedy_and_greedy_rows_mix_with_random_rows():
    torch.manual_seed(1)
    logits = torch.randn(8, 100)
    reqs = [make_req(temperature=0.0) if i % 2 else make_req(temperature=1.5, top_k=1 if i == 4 else 0)
            for i in range(8)]
    out = Sampler(seed=0)(logits, reqs)
    argmax = logits.argmax(-1).tolist()
    for i in (1, 3, 4, 5, 7):
        assert out.token_ids[i] == argmax[i]


def test_inputs_are_not_mutated():
    torch.manual_seed(2)
    logits = torch.randn(3, 20)
    before = logits.clone()
    reqs = [make_req(prompt=[1, 2], output=[3, 3], repetition_penalty=1.3, frequency_penalty=0.5,
                     temperature=0.7, top_p=0.8, top_k=5, min_p=0.05, logprobs=2) for _ in range(3)]
    Sampler(seed=0)(logits, reqs)
    assert torch.equal(logits, before)
    assert reqs[0].output_token_ids == [3, 3]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    n = 20_000
    counts = draw(Sampler(seed=123), logits, n, temperature=temperature)
    probs = torch.softmax(logits / temperature, -1).tolist()
    assert chi_square(counts, probs, n) < _CHI2_CRIT[4]


def test_seeded_rows_follow_the_distribution():
    logits = torch.tensor([0.5, 1.5, -1.0, 0.0])
    n = 4_000
    reqs = [make_req(temperature=1.0, seed=s) for s in range(n)]
    counts = Counter(Sampler(seed=0)(logits.expand(n, -1).contiguous(), reqs).token_ids)
    assert chi_square(counts, torch.softmax(logits, -1).tolist(), n) < _CHI2_CRIT[3]


def test_wrong_distribution_is_detected():
    """The chi-square check has teeth: a temperature mix-up fails it."""
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    n = 20_000
    counts = draw(Sampler(seed=123), logits, n, temperature=1.0)
    assert chi_square(counts, torch.softmax(logits / 0.7, -1).tolist(), n) > _CHI2_CRIT[4]


def _renormalized(logits: torch.Tensor, keep: list[int]) -> list[float]:
    probs = torch.softmax(logits, -1)
    mask = torch.zeros_like(probs)
    mask[keep] = 1.0
    kept = probs * mask
    return (kept / kept.sum()).tolist()


def test_top_k_only_picks_the_k_best_with_renormalized_probs():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.3, 1.0, -2.0, 0.9])
    n = 20_000
    counts = draw(Sampler(seed=5), logits, n, top_k=3)
    assert set(counts) == {1, 3, 5}
    assert chi_square(counts, _renormalized(logits, [1, 3, 5]), n) < _CHI2_CRIT[2]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])  # sorted: 1 (.4) 3 (.7) 4 (.85) 2 (.95)
    logits = probs.log()
    n = 20_000
    counts = draw(Sampler(seed=6), logits, n, top_p=0.8)
    assert set(counts) == {1, 3, 4}
    assert chi_square(counts, _renormalized(logits, [1, 3, 4]), n) < _CHI2_CRIT[2]
    assert set(draw(Sampler(seed=6), logits, 2_000, top_p=0.3)) == {1}


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    probs = torch.tensor([0.5, 0.2, 0.04, 0.16, 0.1])
    logits = probs.log()
    n = 20_000
    counts = draw(Sampler(seed=7), logits, n, min_p=0.25)  # keep p >= 0.125
    assert set(counts) == {0, 1, 3}
    assert chi_square(counts, _renormalized(logits, [0, 1, 3]), n) < _CHI2_CRIT[2]


def test_filters_combine_and_apply_after_temperature():
    torch.manual_seed(3)
    logits = torch.randn(64)
    order = logits.argsort(descending=True).tolist()
    counts = draw(Sampler(seed=8), logits, 5_000, top_k=10, top_p=0.9, temperature=0.3)
    assert set(counts) <= set(order[:10])
    # at T = 0.3 a min_p of 0.5 keeps only tokens within 0.3*log(2) of the best logit
    counts = draw(Sampler(seed=8), logits, 5_000, min_p=0.5, temperature=0.3)
    allowed = {i for i in range(64) if logits[i] >= logits.max() + 0.3 * math.log(0.5)}
    assert set(counts) <= allowed


def test_mixed_filters_per_row_in_one_batch():
    torch.manual_seed(4)
    logits = torch.randn(4, 40).repeat(50, 1)  # 200 rows, 4 distinct
    kinds = [dict(top_k=2), dict(top_p=0.2), dict(), dict(min_p=0.6, top_k=-1)]
    reqs = [make_req(**kinds[i % 4]) for i in range(200)]
    out = Sampler(seed=9)(logits, reqs)
    for i, tok in enumerate(out.token_ids):
        row = logits[i]
        if i % 4 == 0:
            assert tok in row.topk(2).indices.tolist()
        elif i % 4 == 1:
            probs, idx = torch.softmax(row, -1).sort(descending=True)
            nucleus = int((probs.cumsum(-1) - probs < 0.2).sum())
            assert tok in idx[:nucleus].tolist()
        elif i % 4 == 3:
            probs = torch.softmax(row, -1)
            assert probs[tok] >= 0.6 * probs.max()
    assert len({t for i, t in enumerate(out.token_ids) if i % 4 == 2}) > 3  # unfiltered row


def test_top_k_rows_leave_unfiltered_rows_whole():
    """When every filtering row has a top_k, the sampler uses topk instead of a full
    sort; rows with top_k disabled (0 or -1) in that batch keep their whole
    vocabulary, and top_p applies to the top-k renormalized probabilities."""
    row = torch.randn(20, generator=torch.Generator().manual_seed(5)) * 0.1
    row[7] = 1.0  # one clear favourite: top-3 renormalized mass of token 7 > 0.4
    kinds = [dict(top_k=2), dict(top_k=0), dict(top_k=-1), dict(top_k=3, top_p=0.4)]
    logits = row.expand(400, -1).contiguous()
    reqs = [make_req(**kinds[i % 4]) for i in range(400)]
    out = Sampler(seed=10)(logits, reqs)
    picks = [{t for i, t in enumerate(out.token_ids) if i % 4 == r} for r in range(4)]
    best2 = set(row.topk(2).indices.tolist())
    assert picks[0] <= best2 and len(picks[0]) == 2
    assert len(picks[1] - best2) > 5 and len(picks[2] - best2) > 5
    assert picks[3] == {7}


def _run_steps(sampler: Sampler, batch_logits, reqs, steps: int) -> None:
    for step in range(steps):
        out = sampler(batch_logits[step], reqs)
        for req, tok in zip(reqs, out.token_ids):
            req.output_token_ids.append(tok)


def test_seeded_request_reproducible_across_batch_compositions():
    torch.manual_seed(10)
    vocab, steps = 300, 12
    target_logits = torch.randn(steps, vocab)
    params = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234)

    alone = make_req(**params)
    _run_steps(Sampler(seed=0), target_logits[:, None, :], [alone], steps)

    # same request, other companions (seeded and unseeded), different position
    others = [make_req(temperature=1.0), make_req(seed=99, min_p=0.1),
              make_req(temperature=0.0), make_req(top_k=3)]
    mixed = make_req(**params)
    reqs = [others[0], others[1], mixed, others[2], others[3]]
    batch = torch.randn(steps, len(reqs), vocab)
    batch[:, 2] = target_logits
    _run_steps(Sampler(seed=777), batch, reqs, steps)
    assert mixed.output_token_ids == alone.output_token_ids

    another = make_req(**params)
    reqs = [another, make_req(temperature=2.0)]
    batch = torch.randn(steps, 2, vocab)
    batch[:, 0] = target_logits
    _run_steps(Sampler(seed=1), batch, reqs, steps)
    assert another.output_token_ids == alone.output_token_ids

    different_seed = make_req(**{**params, "seed": 4321})
    _run_steps(Sampler(seed=0), target_logits[:, None, :], [different_seed], steps)
    assert different_seed.output_token_ids != alone.output_token_ids


def test_unseeded_rows_follow_the_sampler_seed():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    a = Sampler(seed=3)(logits, [make_req() for _ in range(16)]).token_ids
    b = Sampler(seed=3)(logits, [make_req() for _ in range(16)]).token_ids
    c = Sampler(seed=4)(logits, [make_req() for _ in range(16)]).token_ids
    assert a == b and a != c


# -- penalties: compare with a plain-Python reference --------------------------

def reference_penalties(row: list[float], prompt: list[int], output: list[int],
                        rep: float, freq: float, presence: float) -> list[float]:
    out = list(row)
    seen = set(prompt) | set(output)
    for t in seen:
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    counts = Counter(output)
    for t, c in counts.items():
        out[t] -= c * freq + (1.0 if c > 0 else 0.0) * presence
    return out


def test_penalties_match_reference():
    torch.manual_seed(11)
    vocab = 12
    logits = torch.randn(4, vocab) * 3
    cases = [
        dict(prompt=[0, 1, 1], output=[2, 2, 2, 5], repetition_penalty=1.5),
        dict(prompt=[3], output=[4, 4, 7], frequency_penalty=0.7, presence_penalty=-0.3),
        dict(prompt=[], output=[], repetition_penalty=2.0, presence_penalty=1.0),
        dict(prompt=[9, 10], output=[10, 11, 11, 1], repetition_penalty=0.8,
             frequency_penalty=-1.2, presence_penalty=2.0),
    ]
    reqs = [make_req(**c) for c in cases]
    got = apply_penalties(logits, reqs)
    for i, (c, req) in enumerate(zip(cases, reqs)):
        sp = req.sampling_params
        want = reference_penalties(logits[i].tolist(), c["prompt"], c["output"],
                                   sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty)
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6), i
    assert not torch.equal(got, logits)


def test_no_penalty_is_a_no_op_returning_the_same_tensor():
    logits = torch.randn(2, 10)
    reqs = [make_req(prompt=[1, 2], output=[3]) for _ in range(2)]
    assert apply_penalties(logits, reqs) is logits


def test_penalties_only_touch_their_rows_and_steer_greedy():
    logits = torch.tensor([[5.0, 4.9, 0.0], [5.0, 4.9, 0.0]])
    reqs = [make_req(output=[0], frequency_penalty=0.5, temperature=0.0),
            make_req(output=[0], temperature=0.0)]
    out = Sampler(seed=0)(logits, reqs)
    assert out.token_ids == [1, 0]
    reqs = [make_req(prompt=[0], repetition_penalty=1.1, temperature=0.0)]
    assert Sampler(seed=0)(logits[:1], reqs).token_ids == [1]  # 5 / 1.1 < 4.9


# -- logprobs ------------------------------------------------------------------

def test_logprobs_come_from_raw_logits_with_sorted_alternatives():
    torch.manual_seed(12)
    logits = torch.randn(4, 30)
    reqs = [make_req(logprobs=5, temperature=0.0, repetition_penalty=1.7, prompt=[3, 4]),
            make_req(logprobs=0, temperature=0.8),
            make_req(),
            make_req(logprobs=20, frequency_penalty=1.0, output=[1, 1, 2])]
    out = Sampler(seed=0)(logits, reqs)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i, k in ((0, 5), (1, 0), (3, 20)):
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-6)
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert [t for t, _ in lp.top] == raw[i].topk(k).indices.tolist()
        for t, v in lp.top:
            assert v == pytest.approx(raw[i, t].item(), abs=1e-6)


def test_logprobs_capped_by_vocab():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = Sampler(seed=0)(logits, [make_req(logprobs=20, temperature=0.0)])
    assert [t for t, _ in out.logprobs[0].top] == [2, 1, 0]
    assert out.token_ids == [2]


def test_top_p_one_keeps_the_tail_even_when_the_cumsum_saturates():
    """In float32 the mass before a far-tail token rounds to 1.0; a row with
    top_p == 1 in a batch that sorts for another row must still keep it."""
    from splitserve.engine.sampling.sampler import _filter

    logits = torch.zeros(2, 50)
    logits[:, 0] = 30.0  # p0 = 1 - 5e-12: the cumsum reaches 1.0 right after it
    kept = _filter(logits, [SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)])
    assert torch.isfinite(kept[0]).all()
    assert torch.isfinite(kept[1]).sum() == 1
