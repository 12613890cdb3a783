"""DeepSeek-V3-class simulated nodes (deploy/planner/sim_profiles.py, roofline.py): the MLA latent
prices the KV (layers x (kv_lora + rope) x itemsize, not heads), a data-parallel rank holds
the dense part plus E/N experts and pays the engine's all_gather + all_reduce over its N
ranks (NVLink within a host, RDMA across), a DP profile's simulated node runs, ``plan``
reports DP per pool, and a bad MLA or DP field is refused by name."""

import math

import pytest

from splitserve.common.config import EngineConfig
from splitserve.deploy.planner.roofline import MoeCost, expected_experts
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.planner.sim_profiles import PROFILES_FILE, get_deployment, load_profiles
from splitserve.deploy.planner.offline.report import as_dict
from splitserve.deploy.planner.offline.search import evaluate, search
from splitserve.deploy.planner.offline.workload import Phase, as_reqs, generate
from splitserve.deploy.planner.slo import Slo
from splitserve.engine.engine_core import EngineCore

# deepseek-ai/DeepSeek-V3 config.json
V3 = dict(parameters=671e9, layers=61, hidden=7168, heads=128, dense_layers=3, experts=256, k=8, inter=2048,
          vocab=129280, kv_lora=512, rope=64, nope=128, v=128)
EXPERT = 3 * 7168 * 2048  # one routed expert in one layer
ROUTED = (61 - 3) * 256 * EXPERT
DENSE = 671e9 - ROUTED  # attention, embeddings, dense MLPs, shared experts, routers
GB = 1e9


@pytest.fixture(scope="module")
def profiles():
    return load_profiles()


def test_kv_bytes_per_token_come_from_the_latent_not_the_heads(profiles):
    for name in ("deepseek-v3-dp8ep8-h200", "deepseek-v3-dp16ep16-h200", "deepseek-v3-dp32ep32-h200"):
        p = profiles[name]
        assert p.mla and p.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272  # one rank, one latent
        assert p.block_bytes == 70_272 * 16
    tp8 = profiles["deepseek-v3-tp8-h200"]
    assert tp8.kv_bytes_per_token == 8 * 70_272  # TP: the latent has no heads to split, every rank a replica
    # the MLA attention FLOPs: keys and values expanded per head (nope + rope for QK, v for PV)
    assert profiles["deepseek-v3-dp8ep8-h200"].roofline.attn_flops == 2 * 61 * 128 * (128 + 64 + 128)
    assert profiles["deepseek-v3-dp8ep8-h200"].context == 163840


def test_active_parameters_and_weights_per_gpu(profiles):
    p8, p16, p32 = (profiles[f"deepseek-v3-dp{n}ep{n}-h200"] for n in (8, 16, 32))
    assert p8.active_parameters == pytest.approx(DENSE + 58 * 8 * EXPERT)
    assert p8.active_parameters == pytest.approx(37e9, rel=0.03)
    assert 17.0e9 < DENSE < 17.3e9
    for p, n in ((p8, 8), (p16, 16), (p32, 32)):
        assert (p.gpus, p.dp, p.ep, p.node_gpus, p.experts_per_gpu) == (n, n, n, 1, 256 // n)
        assert p.weight_bytes_per_param == 1  # FP8
        assert p.weight_bytes == int(DENSE + ROUTED / n)  # dense part + E/N experts, 1 byte each
        assert p.weight_bytes_per_gpu == p.weight_bytes
        assert p.expert_bytes_per_gpu == int(ROUTED / n)
        assert p.roofline.weight_bytes == pytest.approx(DENSE)  # every rank reads the whole dense part
    assert 98 * GB < p8.weight_bytes < 100 * GB and 37 * GB < p32.weight_bytes < 38 * GB
    # the KV pool is one GPU's memory less the rank's weights and activations
    assert p8.kv_pool_bytes == int(140.4 * 2**30 * 0.9 - p8.weight_bytes - 8 * 2**30)
    assert p32.kv_pool_tokens > 3 * p8.kv_pool_tokens
    tp8 = profiles["deepseek-v3-tp8-h200"]
    assert (tp8.node_gpus, tp8.dp, tp8.weight_bytes) == (8, 1, int(671e9))


def test_bf16_weights_do_not_fit_a_dp8_rank(tmp_path):
    text = PROFILES_FILE.read_text()
    path = tmp_path / "p.toml"
    path.write_text(text.replace("weight_bytes_per_param = 1   # FP8", "weight_bytes_per_param = 2   # bf16", 1))
    with pytest.raises(ValueError, match=r"profile deepseek-v3-dp8ep8-h200: its weights do not fit: 198 GB per GPU"):
        load_profiles(path)


def test_dp_collective_volume_is_the_engines_gather_and_reduce():
    m = MoeCost(experts=256, top_k=8, moe_layers=58, expert_bytes=58 * EXPERT, ep=16, hidden=7168,
                dtype_bytes=2, link_bytes_per_s=50e9, link_latency_s=10e-6, dp=16)
    t, n, row = 100, 16, 100 * 7168 * 2
    gather = (n - 1) * row  # every other rank's padded tokens
    reduce = 2 * (n - 1) / n * (n * row)  # a ring all_reduce of [N x P, hidden]
    assert m.dp_collective_bytes(t) == pytest.approx(58 * (gather + reduce))
    assert m.dp_collective_bytes(t) == pytest.approx(58 * 3 * (n - 1) * row)
    assert m.all_to_all_seconds(t) == m.dp_collective_seconds(t) == pytest.approx(
        58 * 3 * 15 * row / 50e9 + 58 * 3 * math.ceil(math.log2(16)) * 10e-6)
    assert m.dp_collective_bytes(0) == 0.0 and m.all_to_all_seconds(0) == 0.0
    # heavier than a true all-to-all of the same tokens (2 T k hidden (N-1)/N), and growing with N
    a2a = 2 * t * 8 * 7168 * 2 * (n - 1) / n * 58
    assert m.dp_collective_bytes(t) > a2a
    m32 = MoeCost(experts=256, top_k=8, moe_layers=58, expert_bytes=1, ep=32, hidden=7168, dtype_bytes=2,
                  link_bytes_per_s=50e9, dp=32)
    assert m32.dp_collective_bytes(t) / m.dp_collective_bytes(t) == pytest.approx(31 / 15)
    # a rank reads its share of the experts ALL ranks' tokens touch
    assert m.expert_read_bytes(t) == pytest.approx(58 * EXPERT * expected_experts(256, 8, 16 * t) / 16)
    assert m.expert_read_bytes(1) == pytest.approx(58 * EXPERT * expected_experts(256, 8, 16) / 16)
    with pytest.raises(ValueError, match="moe dp"):
        MoeCost(experts=256, top_k=8, moe_layers=58, expert_bytes=1, ep=8, hidden=1, dp=3, link_bytes_per_s=1.0)


def test_a_rank_step_is_one_gpu_plus_the_collective_over_nvlink_or_rdma(profiles):
    p8, p16 = profiles["deepseek-v3-dp8ep8-h200"], profiles["deepseek-v3-dp16ep16-h200"]
    r = p8.roofline
    assert r.flops_per_s == pytest.approx(989e12 * 0.55) and r.bytes_per_s == pytest.approx(4.8e12 * 0.70)
    assert (r.moe.dp, r.moe.link_bytes_per_s) == (8, 450e9)  # within one host: NVLink
    assert (p16.roofline.moe.dp, p16.roofline.moe.link_bytes_per_s) == (16, 50e9)  # two hosts: RDMA
    assert r.flops_per_token == pytest.approx(2 * (p8.active_parameters - 129280 * 7168))
    one = r.step_seconds(32, 32 * 8192, [])
    expect = (max((r.flops_per_token * 32 + r.attn_flops * 32 * 8192) / r.flops_per_s,
                  (DENSE + r.moe.expert_read_bytes(32) + 70_272 * 32 * 8192) / r.bytes_per_s)
              + r.moe.dp_collective_seconds(32) + r.step_overhead_s)
    assert one == pytest.approx(expect)
    # the same tokens per rank cost a DP16 rank more: twice the ranks' rows over a slower link
    assert p16.roofline.step_seconds(32, 32 * 8192, []) > one
    assert p8.kv_network_bytes_per_s == 50e9  # one rank: one NIC


def test_a_dp_rank_simulated_node_runs(bundled_dir, profiles):
    """One DP32 rank as a simulated node: DeepSeek-V3's context, the rank's KV pool in latent
    tokens, and each step the rank's roofline with the collective over 32 ranks."""
    p = profiles["deepseek-v3-dp32ep32-h200"]
    engine = EngineCore(EngineConfig(model=str(bundled_dir), kv_cache_memory=p.kv_pool_bytes,
                                     block_size=p.block_size, prefill_chunk_size=p.prefill_chunk_size,
                                     max_num_batched_tokens=p.max_num_batched_tokens,
                                     sim=p.sim_config(speedup=1000.0)))
    assert engine.max_model_len == 163840 and engine.kv_capacity_tokens == p.kv_pool_tokens
    engine.add_request("ds", engine.prompt_ref(list(range(1000, 1000 + 10000))), SamplingParams(max_tokens=3))
    out = []
    while engine.has_unfinished():
        out += engine.step()
    assert out[-1].finish_reason == "length"
    sim = p.sim_config()
    expected = p.prefill_seconds(10000) + sim.step_seconds(1, [], 10001) + sim.step_seconds(1, [], 10002)
    assert engine.runner.simulated_seconds == pytest.approx(expected, rel=0.05)
    # a decode step of one token still pays the collective's latency over 32 ranks on RDMA
    assert sim.step_seconds(1, [], 10001) > p.roofline.moe.dp_collective_seconds(1) > 58 * 15 * 10e-6


def test_plan_returns_dp_per_pool(profiles):
    slo = Slo(ttft_s=3.0, itl_s=0.15)
    reqs = as_reqs(generate((Phase(20, 2.0, 3000, 60, 0.3),), 0, 163840))
    dep = get_deployment("deepseek-v3-p-dp16-d-dp32-h200")
    c = evaluate(reqs, dep, 1, 1, slo)
    assert (c.prefill_dp, c.decode_dp, c.prefill_ep, c.decode_ep) == (16, 32, 16, 32)
    assert c.devices == 16 + 32  # one DP16 node and one DP32 node: their GPUs
    assert c.label().startswith("1P:1D DP16/EP16:DP32/EP32")
    res = search(reqs, get_deployment("deepseek-v3-dp8ep8-h200"), slo, max_nodes=2)
    assert res.best is not None
    layouts = {(x.prefill_profile, x.decode_profile) for x in res.evaluated}
    assert ("deepseek-v3-dp8ep8-h200", "deepseek-v3-dp32ep32-h200") in layouts  # DP searched per pool
    assert ("deepseek-v3-tp8-h200", "deepseek-v3-dp8ep8-h200") in layouts  # beside TP8
    for x in res.evaluated:
        p, d = profiles[x.prefill_profile], profiles[x.decode_profile]
        assert (x.prefill_dp, x.decode_dp) == (p.dp, d.dp)
        assert x.devices == x.prefill_nodes * p.gpus + x.decode_nodes * d.gpus
    assert {"prefill_dp", "decode_dp", "label"} <= set(as_dict(res.best))


@pytest.mark.parametrize("change,match", [
    (("kv_lora_rank = 512", "kv_lora_rank = 0"), "model deepseek-v3: kv_lora_rank = 0 must be a whole number"),
    (("qk_rope_head_dim = 64\n", ""), "model deepseek-v3: missing field 'qk_rope_head_dim'"),
    (("v_head_dim = 128\n", "v_head_dim = 128\nkv_heads = 128\n"), "model deepseek-v3: kv_heads on an MLA model"),
    (("dp = 8\n", "dp = 4\n"), "profile deepseek-v3-dp8ep8-h200: dp = 4 must equal gpus = 8"),
    (("dp = 8\n", "dp = 0\n"), "profile deepseek-v3-dp8ep8-h200: dp = 0 must be a whole number"),
    (("dp = 8\nep = 8\n", "dp = 8\nep = 4\n"), "profile deepseek-v3-dp8ep8-h200: dp = 8 needs ep = 8"),
    (('scale_out = "rdma-400g"      # one 400', 'scale_out = "ib-9000"      # one 400'),
     "profile deepseek-v3-dp16ep16-h200: dp = 16 needs its hardware's scale_out"),
    (("weight_bytes_per_param = 1   # FP8", "weight_bytes_per_param = 0   # FP8"),
     "profile deepseek-v3-dp8ep8-h200: weight_bytes_per_param = 0 must be a number > 0"),
])
def test_bad_fields_are_refused_naming_the_field(tmp_path, change, match):
    text = PROFILES_FILE.read_text()
    assert change[0] in text
    path = tmp_path / "p.toml"
    path.write_text(text.replace(*change, 1))
    with pytest.raises(ValueError, match=match):
        load_profiles(path)


def test_dp_on_a_dense_model_is_refused(tmp_path):
    text = PROFILES_FILE.read_text()
    path = tmp_path / "p.toml"
    path.write_text(text.replace("[profile.llama3-70b-tp8-h100]", "[profile.llama3-70b-tp8-h100]\ndp = 8", 1))
    with pytest.raises(ValueError, match="profile llama3-70b-tp8-h100: dp = 8 on a dense model"):
        load_profiles(path)
