"""Simulated-node profiles: the derived numbers follow the stated formulas (TP4 and
TP8 on H100s by the same rules), the roofline behaves like one (decode
bandwidth-bound, long prefill compute-bound), a bad profile names itself, a
deployment pairs a TP4 prefill profile with a TP8 decode one and refuses profiles
whose KV differs, and a node standing for a 128k-context model serves a prompt
longer than the bundled model's 8192 tokens."""

import subprocess
import sys

import pytest

from splitserve.common.config import EngineConfig
from splitserve.deploy.planner.roofline import Roofline
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.planner.sim_profiles import (GIB, PROFILES_FILE, get_deployment, get_profile, load_deployments,
                                            load_profiles, pair)
from splitserve.engine.engine_core import EngineCore


def test_profiles_derive_kv_bytes_pool_and_context():
    profiles = load_profiles()
    assert {"llama3-8b-h100", "qwen3-32b-h100", "llama3-70b-tp4-h100", "smollm2-135m-cpu"} <= set(profiles)
    p = profiles["llama3-8b-h100"]
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert p.context == 131072 and p.weight_bytes == int(8.03e9 * 2)
    assert p.kv_pool_bytes == int(79.6 * GIB * 0.90 - 8.03e9 * 2 - 4.0 * GIB)
    assert p.kv_pool_tokens % p.block_size == 0 and p.kv_pool_tokens > p.context
    tp4 = profiles["llama3-70b-tp4-h100"]
    assert tp4.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert tp4.roofline.flops_per_s == pytest.approx(989e12 * 0.55 * 4 * 0.85)
    assert profiles["smollm2-135m-cpu"].roofline is None  # the fitted CPU timing
    assert not p.calibrated and "not yet calibrated on a device" in PROFILES_FILE.read_text()
    with pytest.raises(ValueError, match="unknown simulated-node profile 'nope'"):
        get_profile("nope")


def test_roofline_is_bandwidth_bound_for_decode_and_compute_bound_for_prefill():
    r = get_profile("llama3-8b-h100").roofline
    one = r.step_seconds(1, 1000, [])
    assert one == pytest.approx(r.weight_bytes / r.bytes_per_s + r.kv_bytes_per_token * 1000 / r.bytes_per_s
                                + r.step_overhead_s)
    assert r.step_seconds(8, 8000, []) < 1.5 * one  # batching decode is nearly free
    chunk = r.step_seconds(0, 0, [(8192, 0)])
    flops = r.flops_per_token * 8192 + r.attn_flops * 8192 * 4096
    assert chunk == pytest.approx(flops / r.flops_per_s + r.step_overhead_s)
    assert r.step_seconds(0, 0, [(8192, 65536)]) > 2 * chunk  # attention over a long context
    with pytest.raises(ValueError, match="flops_per_s"):
        Roofline(1, 1, 1, 1, 0, 1, 0)


def test_policy_weights_price_a_prefill_as_the_roofline_times_it():
    """cache_aware's work W = new + attention x new x (ctx + new / 2), times token_s, is
    the profile's compute-bound prefill step (the router weighs hits as the nodes pay)."""
    from splitserve.router.routing.cache_aware import CacheAware
    from splitserve.router.config import CacheAwareWeights

    p = get_profile("llama3-8b-h100")
    w = CacheAwareWeights(**p.policy_weights())
    policy = CacheAware(w)
    for prompt, hit in ((8192, 0), (32768, 24576), (100_000, 90_000)):
        step = p.roofline.step_seconds(0, 0, [(prompt - hit, hit)]) - p.roofline.step_overhead_s
        assert policy.work(prompt, hit) * w.token_s == pytest.approx(step, rel=1e-9)
    assert w.attention < CacheAwareWeights().attention / 10  # the CPU fit overweighs attention 16x
    assert get_profile("smollm2-135m-cpu").policy_weights() == {}


def test_bad_profile_file_names_the_profile(tmp_path):
    text = PROFILES_FILE.read_text()
    path = tmp_path / "p.toml"
    path.write_text(text + '\n[profile.broken]\nmodel = "llama3-8b"\nhardware = "h100-sxm"\ngpus = 1\n')
    with pytest.raises(ValueError, match="profile broken: missing field 'dtype_bytes'"):
        load_profiles(path)
    path.write_text(text.replace("memory_gib = 79.6", "memory_gib = 20.0"))  # 8B leaves no room for 128k
    with pytest.raises(ValueError, match="profile llama3-8b-h100: its KV pool holds"):
        load_profiles(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_profiles(tmp_path / "missing.toml")


def test_a_128k_profile_node_serves_a_prompt_past_8192_tokens(bundled_dir):
    p = get_profile("llama3-8b-h100")
    engine = EngineCore(EngineConfig(model=str(bundled_dir), kv_cache_memory=p.kv_pool_bytes,
                                     block_size=p.block_size, prefill_chunk_size=p.prefill_chunk_size,
                                     max_num_batched_tokens=p.max_num_batched_tokens,
                                     sim=p.sim_config(speedup=1000.0)))
    assert engine.max_model_len == 131072
    assert engine.kv_capacity_tokens == p.kv_pool_tokens
    engine.add_request("long", engine.prompt_ref(list(range(1000, 1000 + 20000))), SamplingParams(max_tokens=2))
    out = []
    while engine.has_unfinished():
        out += engine.step()
    assert out[-1].finish_reason == "length"
    assert engine.runner.simulated_seconds == pytest.approx(p.prefill_seconds(20000) + 
                                                            p.sim_config().step_seconds(1, [], 20001), rel=0.05)


def test_list_profiles_prints_the_derived_numbers():
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "sim-nodes", "--list-profiles"],
                         capture_output=True, text=True, check=True).stdout
    assert "llama3-8b-h100" in out and "431568" in out and "no (stated)" in out
    assert "llama3-70b-tp8-h100" in out and "1342224" in out  # 8 x 79.6 GiB x 0.9 - 141.2 GB - 32 GiB
    assert ("deployment llama3-70b-p-tp4-d-tp8-h100: prefill nodes llama3-70b-tp4-h100 (TP4), "
            "decode nodes llama3-70b-tp8-h100 (TP8)") in out


H100 = dict(peak=989e12, flops_eff=0.55, hbm=3.35e12, bw_eff=0.70, memory=79.6, overhead=0.003, tp_eff=0.85)
L70B = dict(parameters=70.6e9, layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, vocab=128256)


def test_llama3_70b_tp8_follows_from_the_h100_and_the_model_numbers():
    """Weights and KV over 8 GPUs: the pool is 8 GPUs' memory left after the weights,
    each GPU's FLOPs and bandwidth x tp_efficiency; against TP4, twice the throughput
    (the roofline half as long, the fixed overhead the same) and ~3x the KV tokens."""
    profiles = load_profiles()
    tp8, tp4 = profiles["llama3-70b-tp8-h100"], profiles["llama3-70b-tp4-h100"]
    hw, m = H100, L70B
    assert (tp8.gpus, tp8.model, tp8.context, tp8.block_size, tp8.dtype_bytes) == (8, "llama3-70b", 131072, 16, 2)
    kv_tok = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * 2  # one KV head per rank: none replicated
    assert tp8.kv_bytes_per_token == kv_tok == 327680 == tp4.kv_bytes_per_token
    assert tp8.weight_bytes == int(m["parameters"] * 2)
    pool = int(8 * hw["memory"] * GIB * 0.90 - m["parameters"] * 2 - 8 * 4.0 * GIB)
    assert tp8.kv_pool_bytes == pool
    assert tp8.kv_pool_tokens == pool // (kv_tok * 16) * 16 == 1342224
    assert 2.9 < tp8.kv_pool_tokens / tp4.kv_pool_tokens < 3.0  # 8 GPUs carry the weights 4 did
    r = tp8.roofline
    flops_s = hw["peak"] * hw["flops_eff"] * 8 * hw["tp_eff"]
    bytes_s = hw["hbm"] * hw["bw_eff"] * 8 * hw["tp_eff"]
    assert r.flops_per_s == pytest.approx(flops_s) and r.bytes_per_s == pytest.approx(bytes_s)
    flops_tok = 2 * (m["parameters"] - m["vocab"] * m["hidden"])
    attn = 4 * m["layers"] * m["heads"] * m["head_dim"]
    # per prompt token (compute-bound) and per decode step (bandwidth-bound: weights + context)
    assert tp8.policy_weights()["token_s"] == pytest.approx(flops_tok / flops_s)
    assert tp8.prefill_seconds(8192) == pytest.approx(
        (flops_tok * 8192 + attn * 8192 * 4096) / flops_s + hw["overhead"])
    step = tp8.sim_config().step_seconds(1, [], 8192)
    assert step == pytest.approx((m["parameters"] * 2 + kv_tok * 8192) / bytes_s + hw["overhead"])
    assert step < 2 * hw["overhead"] + 0.01  # ~9 ms of HBM over 8 GPUs
    tp4_step = tp4.sim_config().step_seconds(1, [], 8192)
    assert tp4_step - hw["overhead"] == pytest.approx(2 * (step - hw["overhead"]))
    assert tp4.prefill_seconds(32768) - 4 * hw["overhead"] == pytest.approx(
        2 * (tp8.prefill_seconds(32768) - 4 * hw["overhead"]))  # four chunks of 8192


def test_kv_heads_are_replicated_when_tp_exceeds_them_and_a_tp_that_does_not_split_is_refused(tmp_path):
    base = PROFILES_FILE.read_text()
    path = tmp_path / "p.toml"
    tp16 = base.replace("[profile.llama3-70b-tp8-h100]", "[profile.llama3-70b-tp16-h100]").replace(
        "gpus = 8", "gpus = 16", 1).replace('prefill = "llama3-70b-tp4-h100"\ndecode = "llama3-70b-tp8-h100"',
                                         'prefill = "llama3-70b-tp4-h100"\ndecode = "llama3-70b-tp16-h100"')
    path.write_text(tp16)
    p = load_profiles(path)["llama3-70b-tp16-h100"]
    assert p.kv_bytes_per_token == 2 * 80 * 16 * 128 * 2  # 8 KV heads over 16 ranks: each held twice
    assert load_deployments(path)["llama3-70b-p-tp4-d-tp8-h100"].decode.gpus == 16
    path.write_text(base.replace("gpus = 8", "gpus = 6", 1))
    with pytest.raises(ValueError, match="profile llama3-70b-tp8-h100: 64 query and 8 KV heads do not split over 6"):
        load_profiles(path)


def test_deployment_prefills_on_tp4_decodes_on_tp8_and_prices_prefill_as_tp4():
    from splitserve.router.routing.cache_aware import CacheAware
    from splitserve.router.config import CacheAwareWeights

    d = get_deployment("llama3-70b-p-tp4-d-tp8-h100")
    assert (d.prefill.name, d.decode.name, d.context) == ("llama3-70b-tp4-h100", "llama3-70b-tp8-h100", 131072)
    assert d.policy_weights() == d.prefill.policy_weights()
    assert d.policy_weights()["token_s"] == pytest.approx(2 * d.decode.policy_weights()["token_s"])
    assert d.policy_weights()["attention"] == d.decode.policy_weights()["attention"]  # the model's ratio
    # the router's work of a prompt x token_s is the prefill node's (TP4) compute-bound step
    w = CacheAwareWeights(**d.policy_weights())
    step = d.prefill.roofline.step_seconds(0, 0, [(8192, 0)]) - d.prefill.roofline.step_overhead_s
    assert CacheAware(w).work(8192, 0) * w.token_s == pytest.approx(step, rel=1e-9)
    same = get_deployment("llama3-70b-tp4-h100")  # a profile: both roles on it
    assert same.prefill is same.decode and same.policy_weights() == d.policy_weights()
    with pytest.raises(ValueError, match="is a deployment of two profiles .* --profile llama3-70b-tp8-h100"):
        get_profile("llama3-70b-p-tp4-d-tp8-h100")
    with pytest.raises(ValueError, match="unknown simulated-node profile or deployment 'nope'"):
        get_deployment("nope")


def test_a_pairing_whose_kv_differs_is_refused(tmp_path):
    base = PROFILES_FILE.read_text()
    profiles = load_profiles()
    tp4 = profiles["llama3-70b-tp4-h100"]
    with pytest.raises(ValueError, match="deployment x: prefill profile llama3-70b-tp4-h100 and decode profile "
                                         "llama3-8b-h100 differ in model"):
        pair("x", tp4, profiles["llama3-8b-h100"])
    fp8 = base + ('\n[profile.llama3-70b-tp8-fp8]\nmodel = "llama3-70b"\nhardware = "h100-sxm"\ngpus = 8\n'
                  'dtype_bytes = 1\ngpu_memory_utilization = 0.9\nactivation_gib = 4.0\nblock_size = 16\n'
                  'prefill_chunk_size = 8192\nmax_num_batched_tokens = 8192\nmax_num_seqs = 256\n'
                  '[deployment.mixed]\nprefill = "llama3-70b-tp4-h100"\ndecode = "llama3-70b-tp8-fp8"\n')
    path = tmp_path / "p.toml"
    path.write_text(fp8)
    with pytest.raises(ValueError, match=r"deployment mixed: .* differ in dtype_bytes \(2 vs 1\)"):
        load_deployments(path)
    path.write_text(fp8.replace("block_size = 16\nprefill_chunk_size = 8192\nmax_num_batched_tokens = 8192\n"
                                "max_num_seqs = 256\n[deployment", "block_size = 32\nprefill_chunk_size = 8192\n"
                                "max_num_batched_tokens = 8192\nmax_num_seqs = 256\n[deployment")
                    .replace("dtype_bytes = 1", "dtype_bytes = 2"))
    with pytest.raises(ValueError, match=r"differ in block_size \(16 vs 32\)"):
        get_deployment("mixed", path)
    path.write_text(base.replace('decode = "llama3-70b-tp8-h100"', 'decode = "llama3-70b-tp9"'))
    with pytest.raises(ValueError, match="deployment llama3-70b-p-tp4-d-tp8-h100: decode = 'llama3-70b-tp9' "
                                         "is no profile"):
        load_profiles(path)


def test_profiles_name_their_kv_network_and_prefix_cache_tiers():
    """The GPU profiles move KV over one 400 Gb/s RDMA NIC per GPU and have a host tier of
    4 KV pools at PCIe Gen5 rates and a disk tier of 16 at NVMe rates, times the node's GPUs;
    the CPU profile models neither (its transfers take what this machine's transport takes)."""
    profiles = load_profiles()
    p, tp4, cpu = profiles["llama3-8b-h100"], profiles["llama3-70b-tp4-h100"], profiles["smollm2-135m-cpu"]
    assert (p.kv_network, p.kv_network_bytes_per_s, p.kv_network_latency_s) == ("rdma-400g", 50e9, 10e-6)
    assert tp4.kv_network_bytes_per_s == 4 * 50e9 and tp4.host_bytes_per_s == 4 * 50e9  # a link per GPU
    assert p.host_tier_bytes == 4 * p.kv_pool_bytes and p.disk_tier_bytes == 16 * p.kv_pool_bytes
    assert (p.host_bytes_per_s, p.disk_read_bytes_per_s, p.disk_write_bytes_per_s) == (50e9, 6e9, 3e9)
    assert (cpu.kv_network, cpu.kv_network_bytes_per_s, cpu.host_tier_bytes, cpu.host_bytes_per_s) == ("", 0, 0, 0)
    sim = p.sim_config(speedup=4.0)
    # 16k tokens x 128 KiB per token of Llama-3-8B over 50 GB/s: ~43 ms (before the speed-up)
    assert sim.transfer_seconds(1024, 16) == pytest.approx(16384 * 131072 / 50e9)
    assert 0.0429 < sim.transfer_seconds(1024, 16) < 0.0430
    assert cpu.sim_config().transfer_seconds(1024, 16) == 0.0
    s = p.summary()
    assert (s["kv_network"], s["transfer_16k_ms"], s["host_tier_gib"]) == ("rdma-400g", 42.95, 210.7)


def test_a_profile_naming_an_unknown_network_or_a_disk_without_host_tier_is_refused(tmp_path):
    text = PROFILES_FILE.read_text()
    path = tmp_path / "p.toml"
    path.write_text(text.replace('kv_network = "rdma-400g"', 'kv_network = "carrier-pigeon"', 1))
    with pytest.raises(ValueError, match="kv_network = 'carrier-pigeon' is no"):
        load_profiles(path)
    path.write_text(text.replace("host_tier_pools = 4.0", "host_tier_pools = 0.0", 1))
    with pytest.raises(ValueError, match="a disk tier needs a host tier"):
        load_profiles(path)
    from splitserve.common.config import SimConfig
    with pytest.raises(ValueError, match="give kv_bytes_per_token too"):
        SimConfig(kv_network_bytes_per_s=50e9)
