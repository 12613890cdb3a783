"""Expert parallelism (``enable_expert_parallel``): a MoE model's experts split whole over a
node's tensor-parallel ranks, attention tensor-parallel as before (engine/models/moe.py).

- Loading: rank r of 2 holds experts [r*E/2, (r+1)*E/2) whole, equal to the TP=1 model's
  (safetensors and dummy weights alike), and reads no byte of the other rank's experts.
- Per layer: every MoE block's output (captured from transformers on real prompts) is, summed
  over the EP ranks, within 1e-5 (fp32) of transformers' output of that layer.
- Tokens: two real ranks (gloo) with EP generate transformers' greedy tokens for Qwen3-MoE,
  Mixtral and Qwen2-MoE.
- Through router -> prefill -> decode (real processes, Redis): prefill TP 1 and 2 (EP) and
  decode TP 1, 2 (EP) and 2 (EP), the router's round robin walking every (prefill, decode)
  layout of (1, 1), (2 EP, 1), (1, 2 EP), (2 EP, 2 EP); the KV travels between nodes of
  different EP (the handshake key carries no EP); tokens equal transformers'.
- Kill -9 of one EP rank under load: no request fails, no process of the node is left after
  30 s, it restarts, every pool is free.
- Refusals: EP on a dense model, experts the ranks do not divide.
"""

import asyncio
import os

import openai
import pytest
import torch

from splitserve.common import metric_names as names
from splitserve.common.auth import new_cluster_token
from splitserve.benchmarks.harness import MODEL, wait_pools_free
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.launcher import Cluster
from splitserve.engine.llm import LLM
from splitserve.engine.models.loader import load_model, read_safetensors
from splitserve.engine.models.moe import MoEBlock
from splitserve.engine.models.moe_family import moe_full
from splitserve.engine.models.families import read_model_config
from splitserve.engine.models.sharding import check_model_tp, shard_of
from splitserve.engine.parallel.group import TPGroup
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.tests.test_moe_families import FAMILIES, NEW_TOKENS, PROMPTS
from splitserve.tests.test_tp_cluster import get_json, kill_worker_under_load, metric

os.environ.setdefault("SPLITSERVE_QUIET", "1")


def ep_group(rank: int, size: int) -> TPGroup:
    """Rank ``rank`` of ``size`` with expert parallelism, for building a shard in this process;
    its collectives fail (no process group behind it)."""
    return TPGroup(rank, size, torch.device("cpu"), pg=object(), expert_parallel=True)


class _PartialEP(TPGroup):
    """An EP rank whose all-reduce returns its own part: the test adds the parts up."""

    def all_reduce(self, t, op="sum", timeout_s=None):
        return t


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_ep_rank_holds_its_experts_whole(case, tiny_model_dir):
    family, overrides, _, _ = FAMILIES[case]
    path, _ = tiny_model_dir(family, **overrides)
    cfg = read_model_config(path)
    assert cfg.moe is not None
    half = cfg.moe.num_experts // 2
    for fmt in ("auto", "dummy"):
        full = dict(load_model(path, load_format=fmt).named_parameters())
        for r in range(2):
            mine = load_model(path, load_format=fmt, group=ep_group(r, 2))
            assert mine.shard.expert_parallel and mine.shard.experts == (r * half, (r + 1) * half)
            for name, p in mine.named_parameters():
                assert torch.equal(p, moe_full(name, full[name], mine.shard, cfg)), (fmt, r, name)
                if name.endswith(("mlp.w13", "mlp.w2")):  # whole experts, not columns
                    assert torch.equal(p, full[name][r * half:(r + 1) * half]), (fmt, r, name)
    # rank 1 reads experts half.. only: the others' tensors are never opened
    tensors = read_safetensors(path, shard_of(cfg, 1, 2, expert_parallel=True))
    experts = {int(k.split(".experts.")[1].split(".")[0]) for k in tensors if ".experts." in k}
    assert experts == set(range(half, cfg.moe.num_experts))


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_every_layer_summed_over_ep_ranks_equals_transformers(case, tiny_model_dir):
    family, overrides, dense_layers, _ = FAMILIES[case]
    path, hf = tiny_model_dir(family, **overrides)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (MoE input, transformers' output)
    hooks = [layer.mlp.register_forward_hook(
        lambda m, args, out, i=i: seen.__setitem__(i, (args[0].reshape(-1, args[0].shape[-1]),
                                                       (out[0] if isinstance(out, tuple) else out)
                                                       .reshape(-1, args[0].shape[-1]))))
        for i, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        hf(torch.tensor([PROMPTS[2]]))
    for h in hooks:
        h.remove()
    ranks = [load_model(path, group=_PartialEP(r, 2, torch.device("cpu"), pg=object(), expert_parallel=True))
             for r in range(2)]
    sparse = [i for i in sorted(seen) if i not in dense_layers]
    assert sparse
    for i in sparse:
        x, want = seen[i]
        blocks = [rank.layers[i].mlp for rank in ranks]
        assert all(isinstance(b, MoEBlock) and b.expert_parallel for b in blocks)
        got = sum(b(x) for b in blocks)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"layer {i}: {m}")
        # each rank ran only its experts' pairs, and together every pair once
        assert torch.equal(blocks[0].expert_tokens, blocks[1].expert_tokens)  # the router is replicated


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_llm_ep2_generates_transformers_tokens(case, tiny_model_dir, hf_greedy):
    """Two real ranks (gloo), experts split whole: the tokens of transformers' greedy generate."""
    family, overrides, _, _ = FAMILIES[case]
    path, hf = tiny_model_dir(family, **overrides)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    with LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=True, kv_cache_memory=1 << 20) as llm:
        assert llm.engine.runner.shard.expert_parallel
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want


def test_ep_refusals_name_the_field(tiny_model_dir):
    dense, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="enable_expert_parallel: .* dense model"):
        check_model_tp(read_model_config(dense), 2, expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel"):  # a dense model at TP=1 too
        LLM(str(dense), enable_expert_parallel=True, kv_cache_memory=1 << 20)
    family, overrides, _, _ = FAMILIES["mixtral"]
    odd, _ = tiny_model_dir(family, **dict(overrides, num_local_experts=5))
    with pytest.raises(ValueError, match="do not divide the model's 5 experts"):
        check_model_tp(read_model_config(odd), 2, expert_parallel=True)
    # without EP the same model splits by columns: 48 / 2
    check_model_tp(read_model_config(odd), 2)


# ---- through router -> prefill -> decode --------------------------------------------------------
PREFILL_TP = (1, 2)  # prefill-0, prefill-1 (EP over its 2 ranks)
DECODE_TP = (1, 2, 2)  # decode-0 .. decode-2: with 2 prefill nodes, round robin walks all 6 pairs
NODES = ("prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ep_cluster(request, served_tiny_model):
    """Supervised (as `up` runs it), cluster token and migration; every node with
    --enable-expert-parallel (a no-op at TP 1)."""
    family, overrides, _, _ = FAMILIES[request.param]
    path = served_tiny_model(family, **overrides)
    c = Cluster(prefill_nodes=0, decode_nodes=0, kv_backend="tcp", kv_cache_memory="8MiB", model=str(path),
                served_model_names=[MODEL], policy="round_robin", cluster_token=new_cluster_token(),
                redis_password=new_cluster_token(), extra_node_args=["--transfer-lease", "8"],
                router_args=["--migration-limit", "2"])
    try:
        c.start_redis()
        procs = [c.start_node(role, i, ["--tensor-parallel-size", str(tp), "--enable-expert-parallel"])
                 for role, tps in (("prefill", PREFILL_TP), ("decode", DECODE_TP)) for i, tp in enumerate(tps)]
        procs += c.start_routers()
        for p in procs:
            c.wait_ready(p, 180)
        c.wait_for_nodes(len(NODES), 180)
        c.supervise()
        yield request.param, path, c
    finally:
        c.stop()


@pytest.mark.slow
def test_every_pd_ep_layout_generates_transformers_tokens(ep_cluster, hf_greedy):
    import transformers
    case, path, c = ep_cluster
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[(37 * i + 11 * j + 5) % 40000 + 100 for j in range(20 + 9 * i)] for i in range(6)]
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    tok = RouterTokenizer(path)
    client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=120)
    got = [client.completions.create(model=MODEL, prompt=p, max_tokens=NEW_TOKENS, temperature=0, logprobs=0)
           .choices[0].logprobs.tokens for p in prompts]
    decisions = get_json(f"{c.url}/debug/decisions?limit=6", c.auth_headers())["decisions"][-6:]
    tp = {f"prefill-{i}": t for i, t in enumerate(PREFILL_TP)} | {f"decode-{i}": t for i, t in enumerate(DECODE_TP)}
    layouts = [(tp[d["prefill"]], tp[d["decode"]]) for d in decisions]
    assert {(1, 1), (2, 1), (1, 2), (2, 2)} <= set(layouts), layouts
    for layout, g, w in zip(layouts, got, want):
        assert g == [tok.token_text(t) for t in w], f"{case}: P/D EP {layout}"
    addrs = [c.node(n).addr for n in NODES]
    assert sum(metric(c.node(f"decode-{i}").addr, names.FALLBACK_PREFILLS) for i in range(3)) == 0
    assert all(metric(c.node(f"prefill-{i}").addr, names.KV_BLOCKS_SENT) > 0 for i in range(2))
    for n in ("prefill-1", "decode-1"):  # EP nodes: each rank holds half the experts, whole
        st = get_json(f"{c.node(n).addr}/debug/state", c.auth_headers())
        assert st["tensor_parallel_size"] == 2 and st["expert_parallel"] is True, st
    for addr in addrs:  # both roles export the expert load imbalance, summed over the layers
        assert metric(addr, names.EXPERT_LOAD_IMBALANCE) >= 1
    asyncio.run(wait_pools_free(addrs, c.auth_headers(), 20))


@pytest.mark.slow
def test_killed_ep_rank_fails_no_request_and_the_node_comes_back(ep_cluster):
    case, _, c = ep_cluster
    if case != "qwen3_moe-dense-layer":
        pytest.skip("once, on one family's cluster")
    assert kill_worker_under_load(c, "decode-1", NODES) >= 1  # its streams moved to another decode node
