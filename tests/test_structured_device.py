"""Structured outputs where the logits live: the xgrammar mask applied on the engine's
device in real engine steps (on CUDA: the bitmask filled on the host, copied from pinned
memory, applied by xgrammar's Triton kernel to the rows that have a grammar, inside
async-scheduled steps whose decode runs as CUDA graphs). The model is a tiny random Llama
over the bundled model's vocabulary with its tokenizer copied in, so the same weights load
on every device. The CPU case runs in the default test run; the CUDA case (marked gpu)
must give the CPU's tokens. No jsonschema here: the GPU suite's machine lacks it."""

import json
import re

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.engine.sampling.sampler import Sampler
from splitserve.engine.sampling.structured import GrammarMasker

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]

REGEX = r"[A-Z][a-z]{2,5} [0-9]{2}"
CHOICES = ["yes", "no", "it depends"]
# bounded: a random model cannot make it run past max_tokens
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}}}
MAX_TOKENS = 64
TINY = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)  # head_dim 64: CUDA kernels on a GPU
# Greedy rows: the top-2 gap of the (masked) logits at every step of the CPU run must exceed
# this, so the device's fp32 rounding cannot flip a token (a difference is then a bug).
MIN_GAP = 1e-3


def requests() -> dict[str, tuple[list[int], SamplingParams]]:
    """Grammar rows (greedy, and one seeded random) beside unconstrained rows, one batch."""
    def so(**kwargs):
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(
            **kwargs))
    prompt = [(37 * i + 11) % 30000 + 100 for i in range(12)]
    return {
        "regex": (prompt, so(regex=REGEX)),
        "choice": (prompt[:5], so(choice=CHOICES)),
        "json": (prompt[3:], so(json=SCHEMA)),
        "seeded": (prompt[1:], SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                                              structured_outputs=StructuredOutputsParams(json=SCHEMA))),
        "free": (prompt[2:9], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
        "free_seeded": (prompt[4:], SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)),
    }


def check_grammar(rid: str, text: str) -> None:
    if rid == "regex":
        assert re.fullmatch(REGEX, text), text
    elif rid == "choice":
        assert text in CHOICES, text
    else:
        doc = json.loads(text)
        assert set(doc) == {"name", "ok"} and isinstance(doc["ok"], bool), text
        assert isinstance(doc["name"], str) and len(doc["name"]) <= 8, text


def run(make_engine, path, device, monkeypatch):
    """({rid: tokens}, {rid: finish reason}, the smallest top-2 gap of a greedy row's (masked)
    logits, the devices the grammar rows' logits were on)."""
    engine = make_engine(model=str(path), device=device, dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=8)
    gaps, devices = [], set()
    real_sample = Sampler.sample

    def spy(self, logits, reqs):  # the runner masks the grammar rows, then samples
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if rows:
            devices.add(logits.device.type)
            assert torch.isneginf(logits[rows]).any(dim=1).all()  # every grammar row refuses some tokens
        greedy = [i for i, r in enumerate(reqs) if r.sampling_params.greedy]
        if greedy:
            top = logits[greedy].topk(2, dim=-1).values  # [G, 2]
            rival = torch.isfinite(top[:, 1])  # a step with one allowed token has no rival
            if rival.any():
                gaps.append(float((top[:, 0] - top[:, 1])[rival].min()))
        return real_sample(self, logits, reqs)

    reqs = requests()
    tokens = {rid: [] for rid in reqs}
    reasons = {}
    with monkeypatch.context() as m:
        m.setattr(Sampler, "sample", spy)
        for rid, (ids, params) in reqs.items():
            engine.add_request(rid, engine.prompt_ref(ids), params)
        while engine.has_unfinished():
            for d in engine.step():
                tokens[d.request_id].extend(d.new_token_ids)
                if d.finish_reason is not None:
                    reasons[d.request_id] = d.finish_reason
    assert engine.kv.num_free_blocks == engine.num_blocks
    return tokens, reasons, min(gaps), devices


@pytest.mark.parametrize("device", DEVICES)
def test_grammar_mask_on_the_device(device, tiny_llama_with_tokenizer, make_engine, monkeypatch):
    from transformers import AutoTokenizer

    path, _ = tiny_llama_with_tokenizer(**TINY)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = make_engine(model=str(path), kv_cache_memory=4 << 20)  # on the CPU: the reference mask
    vocab = engine.model_config.vocab_size
    state = engine.grammars.new_state(StructuredOutputsParams(choice=CHOICES).validate())

    # the mask alone: only the grammar row changes, to the CPU mask's allowed set
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    want = GrammarMasker(vocab, torch.device("cpu"))(logits.clone(), [None, state, None])
    got = GrammarMasker(vocab, torch.device(device))(logits.to(device), [None, state, None]).cpu()
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert torch.equal(got[1], want[1]) and 0 < int(torch.isfinite(got[1]).sum()) < 20

    # the engine: every grammar row ends its grammar ("stop") and matches it
    tokens, reasons, gap, devices = run(make_engine, path, device, monkeypatch)
    assert devices == {device}
    for rid in ("regex", "choice", "json", "seeded"):
        assert reasons[rid] == "stop", (rid, tokenizer.decode(tokens[rid]))
        assert tokens[rid][-1] in engine.model_config.eos_token_ids
        check_grammar(rid, tokenizer.decode(tokens[rid], skip_special_tokens=True))
    assert len(tokens["free"]) == len(tokens["free_seeded"]) == 8
    if device == "cpu":
        return
    ref_tokens, ref_reasons, ref_gap, _ = run(make_engine, path, "cpu", monkeypatch)
    assert ref_gap > MIN_GAP, f"the CPU run has a near-tie ({ref_gap}): pick other prompts"
    assert reasons == ref_reasons
    assert tokens == ref_tokens
