"""The MoE families (Qwen3-MoE with a dense layer, Mixtral, Qwen2-MoE with its shared
expert) load from a transformers safetensors folder (per-expert tensors stacked) and
decode greedily token for token like transformers ``generate``; their parameter counts,
total and active; TP=2 (two real ranks) generates TP=1's tokens; each rank's TP=2 slices
are its cut of the whole model and the ranks' partial MoE outputs sum to the whole
block's; bad configs raise ValueError naming the field. Expert parallelism, and the three
families served through router -> prefill -> decode: tests/test_expert_parallel.py."""

import os

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.llm import LLM
from splitserve.engine.models.loader import load_model
from splitserve.engine.models.moe import MoEBlock, expert_load_imbalance
from splitserve.engine.models.moe_family import moe_full
from splitserve.engine.models.families import family_of, model_config, read_model_config
from splitserve.engine.models.sharding import shard_of
from splitserve.engine.parallel.group import TPGroup
from splitserve.tests.tp_ranks import fake_group

os.environ.setdefault("SPLITSERVE_QUIET", "1")

PROMPTS = [[5, 17, 42, 99, 3, 8, 200, 13, 77], [1, 2, 3], list(range(10, 51))]
NEW_TOKENS = 16
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
FAMILIES = {  # case -> (family, transformers config overrides, dense layers, MoE fields expected)
    "qwen3_moe-dense-layer": ("qwen3_moe", dict(MOE, num_experts=4, mlp_only_layers=[1], norm_topk_prob=True,
                                                head_dim=32), (1,), {"norm_topk_prob": True}),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48), (),
                {"norm_topk_prob": True, "intermediate_size": 48}),
    "qwen2_moe-shared": ("qwen2_moe", dict(MOE, num_experts=4, shared_expert_intermediate_size=48), (),
                         {"norm_topk_prob": False, "shared_expert_size": 48}),
}


@pytest.mark.parametrize("case", FAMILIES)
def test_moe_family_matches_transformers(case, tiny_model_dir, make_engine, run_engine, hf_greedy):
    family, overrides, dense_layers, expected = FAMILIES[case]
    path, hf = tiny_model_dir(family, **overrides)
    engine = make_engine(model=str(path), kv_cache_memory=1 << 20, block_size=4)
    cfg = engine.model_config
    assert cfg.moe is not None and cfg.moe.dense_layers == dense_layers
    assert {k: getattr(cfg.moe, k) for k in expected} == expected
    counts = family_of(cfg.architecture).parameters(cfg)
    assert counts.total == sum(p.numel() for p in hf.parameters())
    m, h = cfg.moe, cfg.hidden_size
    sparse = cfg.num_layers - len(dense_layers)
    assert counts.total - counts.active == sparse * (m.num_experts - m.top_k) * 3 * h * m.intermediate_size
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert run_engine(engine, {"long": (PROMPTS[2], greedy)})["long"] == refs[2]
    batch = run_engine(engine, {"a": (PROMPTS[0], greedy), "b": (PROMPTS[1], greedy)})
    assert [batch["a"], batch["b"]] == refs[:2]
    assert engine.kv.num_free_blocks == engine.num_blocks
    imbalance = expert_load_imbalance(engine.runner.model)  # of the last forward
    assert sorted(imbalance) == [i for i in range(cfg.num_layers) if i not in dense_layers]
    assert all(1.0 <= r <= m.num_experts for r in imbalance.values())


@pytest.mark.parametrize("case", ["qwen2_moe-shared", "mixtral"])
def test_tp2_slices_are_the_cut_of_the_whole(case, tiny_model_dir):
    family, overrides, _, _ = FAMILIES[case]
    path, _ = tiny_model_dir(family, **overrides)
    cfg = read_model_config(path)
    for fmt in ("auto", "dummy"):  # dummy: a rank's weights are its cut of the TP=1 dummy model
        full = dict(load_model(path, load_format=fmt).named_parameters())
        for r in range(2):
            mine = load_model(path, load_format=fmt, group=fake_group(r, 2))
            assert dict(mine.named_parameters()).keys() == full.keys()
            for name, p in mine.named_parameters():
                assert torch.equal(p, moe_full(name, full[name], mine.shard, cfg)), (fmt, r, name)


def test_llm_tp2_equals_tp1(tiny_model_dir):
    """Two real ranks (gloo): every expert cut like the dense MLP, the partial sums all-reduced."""
    family, overrides, _, _ = FAMILIES["qwen2_moe-shared"]
    path, _ = tiny_model_dir(family, **overrides)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    with LLM(str(path), kv_cache_memory=1 << 20) as llm1:
        want = [o.token_ids for o in llm1.generate(PROMPTS, params)]
    with LLM(str(path), tensor_parallel_size=2, kv_cache_memory=1 << 20) as llm2:
        assert [o.token_ids for o in llm2.generate(PROMPTS, params)] == want


class _Partial(TPGroup):
    """A rank whose all-reduce returns its own part: the test adds the parts up."""

    def all_reduce(self, t, op="sum", timeout_s=None):
        return t


def test_ranks_partial_moe_outputs_sum_to_the_whole_block():
    cfg = model_config(dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=64, hidden_size=32,
                            intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                            num_experts=5, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2))
    torch.manual_seed(0)
    whole = MoEBlock(cfg, shard_of(cfg, 0, 1), TPGroup.single("cpu"))
    for p in whole.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    x = torch.randn(7, cfg.hidden_size)
    expected = whole(x)
    assert int(whole.expert_tokens.sum()) == 7 * 2  # k experts per token
    summed = torch.zeros_like(x)
    for r in range(2):
        shard = shard_of(cfg, r, 2)
        part = MoEBlock(cfg, shard, _Partial(r, 2, torch.device("cpu"), pg=object()))
        part.load_state_dict({n: moe_full(f"layers.0.mlp.{n}", p, shard, cfg) for n, p in whole.state_dict().items()})
        summed += part(x)
        assert torch.equal(part.expert_tokens, whole.expert_tokens)  # the router is replicated
    torch.testing.assert_close(summed, expected)


def test_dense_layers_from_mlp_only_layers_and_decoder_sparse_step():
    cfg = model_config(dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32,
                            intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                            decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.moe is not None and cfg.moe.dense_layers == (0, 2, 3, 4)


@pytest.mark.parametrize("change, field", [
    ({"num_experts": 0}, "num_experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_moe_config_names_the_field(change, field):
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
               moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=field):
        model_config({**cfg, **change})
