"""Mixture-of-Experts simulated-node profiles (deploy/planner/sim_profiles.py, roofline.py): the
shapes give the model cards' active parameters, FLOPs count only those, a step reads the
dense part plus the experts its tokens touch (k per layer at batch 1, nearly all E at a
large batch), EP2 halves each GPU's expert weights and adds the all-to-all, a simulated
node stands for a MoE model, ``plan`` chooses the EP of each pool, and a bad MoE field is
refused by name."""

import json
import subprocess
import sys

import pytest

from splitserve.common.config import EngineConfig
from splitserve.deploy.planner.roofline import expected_experts
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.planner.sim_profiles import PROFILES_FILE, get_deployment, load_profiles
from splitserve.deploy.planner.offline.fleetsim import StepSum
from splitserve.deploy.planner.offline.report import as_dict
from splitserve.deploy.planner.offline.search import search
from splitserve.deploy.planner.offline.workload import Phase, as_reqs, generate
from splitserve.deploy.planner.slo import Slo
from splitserve.engine.engine_core import EngineCore

A3B = dict(parameters=30.5e9, layers=48, hidden=2048, vocab=151936, experts=128, k=8, inter=768)
MOE = ("qwen3-30b-a3b-h100", "qwen3-30b-a3b-ep2-h100", "qwen3-235b-a22b-tp8-h100")


@pytest.fixture(scope="module")
def profiles():
    return load_profiles()


def test_expected_experts_is_k_at_batch_one_and_approaches_e():
    assert expected_experts(128, 8, 1) == pytest.approx(8)
    assert expected_experts(128, 8, 0) == 0.0
    assert expected_experts(128, 8, 2) == pytest.approx(8 + 8 * (1 - 8 / 128))  # the second token's new ones
    assert 127.9 < expected_experts(128, 8, 512) <= 128
    assert expected_experts(8, 2, 64) == pytest.approx(8 * (1 - 0.75 ** 64))


def test_active_parameters_and_flops_follow_the_shapes(profiles):
    p, m = profiles["qwen3-30b-a3b-h100"], A3B
    one = 3 * m["hidden"] * m["inter"]
    routed = m["layers"] * m["experts"] * one
    active = m["parameters"] - routed + m["layers"] * m["k"] * one
    assert p.active_parameters == pytest.approx(active) and active == pytest.approx(3.3e9, rel=0.03)
    assert p.expert_weight_bytes == int(routed * 2) and p.weight_bytes == int(30.5e9 * 2)
    assert profiles["qwen3-235b-a22b-tp8-h100"].active_parameters == pytest.approx(22e9, rel=0.03)
    r = p.roofline
    assert r.flops_per_token == pytest.approx(2 * (active - m["vocab"] * m["hidden"]))  # active, not total
    chunk = r.step_seconds(0, 0, [(8192, 0)])  # a long prefill: compute-bound on active FLOPs
    assert chunk == pytest.approx((r.flops_per_token * 8192 + r.attn_flops * 8192 * 4096) / r.flops_per_s
                                  + r.step_overhead_s)
    assert (p.num_experts, p.experts_per_token, p.ep, p.experts_per_gpu) == (128, 8, 1, 128)


def test_a_step_reads_the_dense_part_and_the_experts_its_tokens_touch(profiles):
    p, m = profiles["qwen3-30b-a3b-h100"], A3B
    r = p.roofline
    expert = m["layers"] * 3 * m["hidden"] * m["inter"] * 2  # one expert, all layers, bf16
    dense = (m["parameters"] - m["layers"] * m["experts"] * 3 * m["hidden"] * m["inter"]) * 2
    assert r.weight_bytes == pytest.approx(dense)
    assert r.step_weight_bytes(1) == pytest.approx(dense + 8 * expert)  # batch 1: k experts a layer
    assert r.step_weight_bytes(4096) == pytest.approx(dense + 128 * expert, rel=1e-6)  # all of them
    assert r.step_weight_bytes(1) < r.step_weight_bytes(8) < r.step_weight_bytes(64)
    one = r.step_seconds(1, 1000, [])
    assert one == pytest.approx((r.step_weight_bytes(1) + r.kv_bytes_per_token * 1000) / r.bytes_per_s
                                + r.step_overhead_s)
    # a batch-1 decode reads ~1/16 of the experts: far less than the 61 GB of weights a dense 30B reads
    assert r.step_weight_bytes(1) < 0.15 * p.weight_bytes


def test_ep2_halves_each_gpus_expert_weights_and_adds_the_all_to_all(profiles):
    one, ep2 = profiles["qwen3-30b-a3b-h100"], profiles["qwen3-30b-a3b-ep2-h100"]
    assert (ep2.gpus, ep2.ep, ep2.experts_per_gpu) == (2, 2, 64)
    assert ep2.expert_bytes_per_gpu == one.expert_bytes_per_gpu // 2
    assert ep2.kv_bytes_per_token == one.kv_bytes_per_token  # attention TP2: the same KV
    assert one.roofline.all_to_all_seconds(64) == 0.0
    m = A3B
    for tokens in (1, 64, 8192):
        volume = 2 * tokens * m["k"] * m["hidden"] * 2 * (2 - 1) / 2 * m["layers"]
        a2a = volume / (2 * 450e9) + 2 * m["layers"] * 3e-6  # nvlink4: 450 GB/s a GPU, 3 us
        assert ep2.roofline.moe.all_to_all_bytes(tokens) == pytest.approx(volume)
        assert ep2.roofline.all_to_all_seconds(tokens) == pytest.approx(a2a)
    r = ep2.roofline
    bare = max(r.flops_per_token * 32 / r.flops_per_s,
               (r.step_weight_bytes(32) + r.kv_bytes_per_token * 32000) / r.bytes_per_s)
    assert r.step_seconds(32, 32000, []) == pytest.approx(bare + r.all_to_all_seconds(32) + r.step_overhead_s)
    tp8 = profiles["qwen3-235b-a22b-tp8-h100"]
    assert (tp8.gpus, tp8.ep, tp8.experts_per_gpu) == (8, 8, 16)


@pytest.mark.parametrize("name", MOE)
def test_decode_runs_in_closed_form_equal_the_steps(name):
    steps = StepSum(get_deployment(name).decode)
    for b, c0, n in [(1, 100, 7), (64, 64 * 2000, 300), (200, 200 * 3000, 50)]:
        assert steps.total(b, c0, n) == pytest.approx(sum(steps.one(b, c0 + i * b) for i in range(n)), rel=1e-9)


def test_a_simulated_node_stands_for_a_moe_model(bundled_dir, profiles):
    p = profiles["qwen3-30b-a3b-ep2-h100"]
    engine = EngineCore(EngineConfig(model=str(bundled_dir), kv_cache_memory=p.kv_pool_bytes,
                                     block_size=p.block_size, prefill_chunk_size=p.prefill_chunk_size,
                                     max_num_batched_tokens=p.max_num_batched_tokens,
                                     sim=p.sim_config(speedup=1000.0)))
    assert engine.max_model_len == 40960 and engine.kv_capacity_tokens == p.kv_pool_tokens
    engine.add_request("moe", engine.prompt_ref(list(range(1000, 1000 + 10000))), SamplingParams(max_tokens=3))
    out = []
    while engine.has_unfinished():
        out += engine.step()
    assert out[-1].finish_reason == "length"
    sim = p.sim_config()
    expected = p.prefill_seconds(10000) + sim.step_seconds(1, [], 10001) + sim.step_seconds(1, [], 10002)
    assert engine.runner.simulated_seconds == pytest.approx(expected, rel=0.05)


def test_plan_chooses_the_ep_of_each_pool(tmp_path):
    reqs = as_reqs(generate([Phase(30, 6.0, 3000, 200)], seed=2))
    result = search(reqs, get_deployment("qwen3-30b-a3b-h100"), Slo(1.0, 0.015), max_nodes=8)
    pairs = {(c.prefill_ep, c.decode_ep) for c in result.evaluated}
    assert pairs == {(1, 1), (1, 2), (2, 1), (2, 2)}  # the 1-GPU EP1 and the 2-GPU EP2 profile, per pool
    b = result.best
    assert b is not None and b.meets and b.prefill_ep in (1, 2) and b.decode_ep in (1, 2)
    assert f"EP{b.prefill_ep}:EP{b.decode_ep}" in b.label()
    d = as_dict(b)
    assert (d["prefill_ep"], d["decode_ep"]) == (b.prefill_ep, b.decode_ep)
    dense = search(reqs[:40], get_deployment("llama3-8b-h100"), Slo(1.0, 0.015), max_nodes=4)
    assert {(c.prefill_ep, c.decode_ep) for c in dense.evaluated} == {(0, 0)} and "EP" not in dense.evaluated[0].label()


def test_the_plan_cli_writes_each_pools_ep(tmp_path):
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "-m", "splitserve.cli", "plan", "--profile", "qwen3-30b-a3b-h100",
                          "--phase", "20:4:2000:100", "--ttft-p90", "1000", "--itl-p90", "15",
                          "--max-nodes", "6", "--result-json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    best = json.loads(out.read_text())["best"]
    assert best["prefill_ep"] in (1, 2) and best["decode_ep"] in (1, 2) and "EP" in run.stdout


@pytest.mark.parametrize("edit, match", [
    (("num_experts = 128\nexperts_per_token = 8\nmoe_intermediate = 768",
      "num_expert = 128\nexperts_per_token = 8\nmoe_intermediate = 768"),
     "model qwen3-30b-a3b: unknown field 'num_expert'"),
    (("experts_per_token = 8\nmoe_intermediate = 768", "experts_per_token = 200\nmoe_intermediate = 768"),
     "model qwen3-30b-a3b: experts_per_token = 200 exceeds num_experts = 128"),
    (("experts_per_token = 8\nmoe_intermediate = 768", "experts_per_token = 8"),
     "model qwen3-30b-a3b: missing field 'moe_intermediate'"),
    (("moe_intermediate = 768", "moe_intermediate = 0"), "model qwen3-30b-a3b: moe_intermediate = 0 must be"),
    (("num_experts = 128\nexperts_per_token = 8\nmoe_intermediate = 768",
      "num_experts = 128.5\nexperts_per_token = 8\nmoe_intermediate = 768"),
     "model qwen3-30b-a3b: num_experts = 128.5 must be a whole number"),
    (("moe_intermediate = 768", "moe_intermediate = 768\ndense_layers = 48"),
     "model qwen3-30b-a3b: dense_layers = 48 leaves no MoE layer"),
    (("active_parameters = 3.3e9", "active_parameters = 5e9"),
     "model qwen3-30b-a3b: active_parameters = 5e\\+09 but the shapes give"),
    (("gpus = 2\nep = 2", "gpus = 2\nep = 3"), "profile qwen3-30b-a3b-ep2-h100: ep = 3 must divide"),
    (("gpus = 1\nep = 1\n", "gpus = 1\nep = 0\n"), "profile qwen3-30b-a3b-h100: ep = 0 must be"),
    (('model = "llama3-8b"\nhardware = "h100-sxm"\ngpus = 1\n',
      'model = "llama3-8b"\nhardware = "h100-sxm"\ngpus = 1\nep = 1\n'), None),
    (('model = "llama3-70b"\nhardware = "h100-sxm"\ngpus = 4\n',
      'model = "llama3-70b"\nhardware = "h100-sxm"\ngpus = 4\nep = 4\n'),
     "profile llama3-70b-tp4-h100: ep = 4 on a dense model"),
    (('interconnect = "nvlink4"', 'interconnect = "nvlink5"'),
     "profile qwen3-30b-a3b-ep2-h100: ep = 2 needs its hardware's interconnect"),
])
def test_a_bad_moe_field_is_refused_by_name(tmp_path, edit, match):
    text = PROFILES_FILE.read_text()
    assert text.count(edit[0]) >= 1
    path = tmp_path / "p.toml"
    path.write_text(text.replace(edit[0], edit[1], 1))
    if match is None:
        assert load_profiles(path)["llama3-8b-h100"].ep == 1  # ep = 1 on a dense model is the default
        return
    with pytest.raises(ValueError, match=match):
        load_profiles(path)
