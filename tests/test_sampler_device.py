"""The sampler reads the device once per step: one host copy of the sampled ids (with
the logprobs packed in), whatever mix of greedy, filtered, penalized, seeded and
logprob rows the batch holds; and the packed logprobs equal a direct computation.
On CUDA (marked gpu) the same batch is sampled on the device without a host wait and
gives the CPU's tokens."""

from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.sampling.sampler import Sampler


def make_req(prompt=(), output=(), stop_ids=(), **params) -> SimpleNamespace:
    sp = SamplingParams(**params).validate()
    gen = None if sp.seed is None else torch.Generator().manual_seed(sp.seed)  # on the CPU, as the engine's
    return SimpleNamespace(sampling_params=sp, prompt_token_ids=list(prompt), output_token_ids=list(output),
                           generator=gen, stop_ids=frozenset(stop_ids))

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


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def device_batch(logits: torch.Tensor) -> list[SimpleNamespace]:
    """mixed_batch plus a logit_bias row and a min_tokens row whose stop id is its argmax."""
    return mixed_batch() + [
        make_req(temperature=0, logit_bias={5: 40.0, 9: -3.0}, logprobs=1),
        make_req(output=[1], stop_ids=[int(logits[8].argmax())], temperature=0, min_tokens=3),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_on_the_device_gives_the_cpu_tokens(device):
    """Sampled where the logits live: queued without a host wait (CUDA's sync debug mode
    raises on any), one host read, then the CPU's tokens for every greedy row (penalties,
    bias and min_tokens applied on the device) and every seeded row (its noise comes from
    its CPU generator), an unseeded row inside its top-p nucleus, and the CPU's logprobs."""
    logits = torch.randn(9, 64, generator=torch.Generator().manual_seed(3)) * 3
    want = Sampler(seed=0)(logits, device_batch(logits))
    reqs = device_batch(logits)  # fresh generators, same seeds
    sampler = Sampler(seed=0)
    on_device = logits.to(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with HostReads() as reads:
            pending = sampler.sample(on_device, reqs)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert reads.count == 0 and pending.token_ids.device == on_device.device
    with HostReads() as reads:
        got = pending.to_host()
    assert reads.count == 1
    assert torch.equal(on_device.cpu(), logits)  # the sampler never writes its input

    random_unseeded = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy and r.generator is None]
    assert random_unseeded == [3]
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        if i not in random_unseeded:
            assert a == b, f"row {i}: {a} on {device}, {b} on the cpu"
    probs, order = logits[3].softmax(-1).sort(descending=True)  # row 3: temperature 1, top_p 0.8
    nucleus = order[(probs.cumsum(0) - probs) < 0.8].tolist()
    assert got.token_ids[3] in nucleus
    assert got.token_ids[7] == 5 and got.token_ids[8] != int(logits[8].argmax())  # bias, min_tokens
    ref = torch.log_softmax(logits, dim=-1)
    for i, (lp, req) in enumerate(zip(got.logprobs, reqs)):
        if req.sampling_params.logprobs is None:
            assert lp is None
            continue
        assert lp.token_id == got.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-5)
        assert [t for t, _ in lp.top] == ref[i].topk(req.sampling_params.logprobs).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx([v for _, v in want.logprobs[i].top], abs=1e-5)
