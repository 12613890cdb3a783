"""The sampler reads the device once per step: one host copy of the sampled ids (with
the logprobs packed in), whatever mix of greedy, filtered, penalized, seeded and
logprob rows the batch holds; and the packed logprobs equal a direct computation."""

from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.sampler import Sampler


def make_req(prompt=(), output=(), **params) -> SimpleNamespace:
    sp = SamplingParams(**params).validate()
    gen = None if sp.seed is None else torch.Generator().manual_seed(sp.seed)
    return SimpleNamespace(sampling_params=sp, prompt_token_ids=list(prompt), output_token_ids=list(output),
                           generator=gen)

# every way a tensor's values reach Python (each is a device-to-host copy on a GPU)
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy,
               torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def mixed_batch():
    return [
        make_req(temperature=0),
        make_req(temperature=0, logprobs=3),
        make_req(temperature=0.7, top_k=5, seed=11),
        make_req(temperature=1.0, top_p=0.8, logprobs=2),
        make_req(temperature=0.9, min_p=0.1, seed=3),
        make_req(prompt=[1, 2, 3], output=[4, 4, 5], temperature=0, repetition_penalty=1.3,
                 frequency_penalty=0.5, presence_penalty=0.2),
        make_req(output=[7, 8], temperature=1.2, top_k=10, top_p=0.9, presence_penalty=0.4, seed=5, logprobs=4),
    ]


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_one_host_read_per_step(with_logprobs):
    reqs = mixed_batch()
    if not with_logprobs:
        reqs = [r for r in reqs if r.sampling_params.logprobs is None]
    logits = torch.randn(len(reqs), 64, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(seed=0)
    with HostReads() as reads:
        out = sampler(logits, reqs)
    assert reads.count == 1
    assert len(out.token_ids) == len(reqs) and all(isinstance(t, int) for t in out.token_ids)


def test_packed_logprobs_equal_a_direct_computation():
    reqs = mixed_batch()
    logits = torch.randn(len(reqs), 64, generator=torch.Generator().manual_seed(1)) * 3
    out = Sampler(seed=0)(logits, reqs)
    ref = torch.log_softmax(logits, dim=-1)
    for i, (req, lp) in enumerate(zip(reqs, out.logprobs)):
        k = req.sampling_params.logprobs
        if k is None:
            assert lp is None
            continue
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == ref[i, out.token_ids[i]].item()  # exact: float32 -> float64 is lossless
        values, ids = ref[i].topk(k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == values.tolist()


def test_seeded_rows_same_tokens_batched_or_alone():
    """Seeded rows reach the device in one stacked copy; each still follows only its own seed."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    params = dict(temperature=1.0, top_k=20)
    together = [make_req(seed=s, **params) for s in (1, 2, 3)]
    alone = [make_req(seed=s, **params) for s in (1, 2, 3)]
    sampler = Sampler(seed=0)
    for _ in range(4):
        batched = sampler(logits, together).token_ids
        single = [sampler(logits[i:i + 1], [alone[i]]).token_ids[0] for i in range(3)]
        assert batched == single
