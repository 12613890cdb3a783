"""Simulated-node profiles: the derived numbers follow the stated formulas, the
roofline behaves like one (decode bandwidth-bound, long prefill compute-bound), a
bad profile names itself, and a node standing for a 128k-context model serves a
prompt longer than the bundled model's 8192 tokens."""

import subprocess
import sys

import pytest

from splitserve.common.config import EngineConfig
from splitserve.common.roofline import Roofline
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.sim_profiles import GIB, PROFILES_FILE, get_profile, load_profiles
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
    from splitserve.router.cache_aware import CacheAware
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
    engine.add_request("long", list(range(1000, 1000 + 20000)), SamplingParams(max_tokens=2))
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
