"""Adding a model family: a toy family defined in one file outside the package
(tests/toy_family.py: an architecture transformers does not have, Meta's tensor names,
two config fields named its own way) and named in $SPLITSERVE_MODEL_FAMILIES serves
token for token like transformers' LlamaForCausalLM on the same weights (fp32, CPU):
offline, and through real processes (redis-server, router -> prefill -> decode). Without
the variable the architecture is refused naming it; the router, which never imports the
engine, starts on the folder either way."""

import os
from pathlib import Path

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.llm import LLM
from splitserve.engine.models.families import FAMILIES_ENV, family_of, read_model_config
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.tests.served_cluster import assert_serves_greedy
from splitserve.tests.toy_family import ARCHITECTURE, save_toy_checkpoint

TOY_FILE = str(Path(__file__).with_name("toy_family.py"))
PROMPTS = [[5, 17, 42, 99, 3, 8, 200, 13, 77] * 3, [1, 2, 3, 4, 5, 6, 7]]
NEW_TOKENS = 16
os.environ.setdefault("SPLITSERVE_QUIET", "1")


@pytest.fixture(scope="module")
def toy(served_tiny_model, tmp_path_factory, hf_greedy):
    """(toy folder, transformers' greedy tokens of each prompt on the same weights)."""
    from transformers import LlamaForCausalLM

    llama = served_tiny_model("llama")
    out = tmp_path_factory.mktemp("toy") / "model"
    save_toy_checkpoint(llama, out)
    hf = LlamaForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert all(len(r) > 4 for r in refs), "the prompts should decode for a while before any EOS"
    return out, refs


def test_unregistered_architecture_is_refused_naming_the_variable(toy, monkeypatch):
    monkeypatch.delenv(FAMILIES_ENV, raising=False)
    with pytest.raises(ValueError, match=f"{ARCHITECTURE} is not supported.*{FAMILIES_ENV}"):
        read_model_config(toy[0])
    assert RouterTokenizer(toy[0]).max_model_len == 256  # the router needs no family


def test_toy_family_matches_transformers_offline(toy, monkeypatch):
    monkeypatch.setenv(FAMILIES_ENV, TOY_FILE)
    path, refs = toy
    cfg = read_model_config(path)
    assert (cfg.architecture, cfg.intermediate_size, cfg.rms_norm_eps) == (ARCHITECTURE, 128, 1e-6)
    counts = family_of(ARCHITECTURE).parameters(cfg)
    with LLM(str(path), kv_cache_memory=8 << 20, block_size=4) as llm:
        assert counts.total == counts.active == sum(p.numel() for p in llm.engine.runner.model.parameters())
        out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert [o.token_ids for o in out] == refs


@pytest.mark.slow
def test_toy_family_served_through_router_prefill_decode(toy, monkeypatch):
    monkeypatch.setenv(FAMILIES_ENV, TOY_FILE)  # every member inherits it
    path, refs = toy
    assert_serves_greedy(path, PROMPTS, refs, NEW_TOKENS)
