"""A simulated node's prefix-cache tiers (engine/sim_runner.py): their sizes are the modelled
model's bytes, as the KV cache's are (a node standing for an H100 with a host tier of 4 KV
pools holds 4 pools' worth of blocks, in stand-in bytes), and a prompt served from the host
tier costs its step the profile's PCIe time for the blocks loaded, beside the forward layer by
layer, instead of the prompt's prefill; the blocks it evicts were written through to the host in the background and cost
the step nothing unless the copy engine is behind."""

import dataclasses

import pytest

from splitserve.common.config import EngineConfig, NodeConfig
from splitserve.common.kv_events import Tier
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.planner.sim_profiles import get_profile
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.kv.tier_spec import Move
from splitserve.engine.sim_runner import standin_block_bytes, standin_tiers
from splitserve.node.sim_fleet import fleet_configs

P = get_profile("llama3-8b-h100")  # 2 MiB blocks of 16 tokens; host <-> device 50 GB/s, disk reads 6 GB/s


def test_tier_sizes_are_the_modelled_models_bytes_and_each_node_gets_its_own_disk_folder(tmp_path):
    engine = EngineConfig(kv_cache_memory=P.kv_pool_bytes, block_size=16, sim=P.sim_config(),
                          kv_offload_memory=P.host_tier_bytes, kv_offload_dir=str(tmp_path),
                          kv_offload_disk_bytes=P.disk_tier_bytes)
    host_blocks = P.host_tier_bytes // P.block_bytes
    assert 0 <= host_blocks - 4 * P.kv_pool_tokens // 16 < 4  # 4 pools of blocks
    scaled = standin_tiers(engine)
    assert scaled.kv_offload_memory == host_blocks * standin_block_bytes(16) == host_blocks * 128
    assert scaled.kv_offload_disk_bytes == P.disk_tier_bytes // P.block_bytes * 128
    configs = fleet_configs(NodeConfig(role="decode", engine=engine), 1, 1, "t")
    assert [c.engine.kv_offload_memory for c in configs] == [scaled.kv_offload_memory] * 2
    assert [c.engine.kv_offload_dir for c in configs] == [str(tmp_path / "t-prefill-0"), str(tmp_path / "t-decode-0")]
    assert standin_tiers(dataclasses.replace(engine, kv_offload_memory=0, kv_offload_dir=None,
                                             kv_offload_disk_bytes=0)).kv_offload_memory == 0


def run(engine: EngineCore, rid: str, prompt: list[int]) -> tuple[int, float]:
    """Serve ``prompt`` alone; its cached tokens and the simulated seconds it took."""
    before = engine.runner.simulated_seconds
    engine.add_request(rid, engine.prompt_ref(prompt), SamplingParams(max_tokens=1))
    out = []
    while engine.has_unfinished():
        out += engine.step()
    return out[-1].num_cached_tokens, engine.runner.simulated_seconds - before


def test_a_prompt_from_the_host_tier_costs_its_load_at_pcie_rate_not_its_prefill(bundled_dir):
    pool = 8192 * P.kv_bytes_per_token  # the device holds 512 blocks: one 8k prompt
    engine = EngineCore(standin_tiers(EngineConfig(
        model=str(bundled_dir), kv_cache_memory=pool, block_size=16, prefill_chunk_size=P.prefill_chunk_size,
        max_num_batched_tokens=P.max_num_batched_tokens, kv_offload_memory=4 * pool,
        sim=P.sim_config(speedup=1000.0))))
    assert engine.kv.tiers is not None and engine.kv.tiers.host_blocks == 4 * 512
    a, b = list(range(1000, 1000 + 8000)), list(range(20000, 20000 + 8000))
    assert run(engine, "a", a)[0] == 0
    engine.kv.take_moves()
    cached, seconds = run(engine, "b", b)  # a's blocks leave the device for the host tier
    assert cached == 0
    cached, seconds = run(engine, "a2", a + [7])  # a again: from the host tier
    block_s = P.block_bytes / 50e9  # 42 us per 2 MiB block over PCIe Gen5
    loaded = cached // 16
    assert cached == 8000 and loaded == 500  # every block of a came back
    compute = P.sim_config().step_seconds(0, [(8001 - cached, cached)])
    # the load beside the forward, layer by layer (32 of them); the blocks it pushed out (b's)
    # reached the host as b ran
    load = loaded * block_s
    assert P.layers == 32 and load > compute
    assert seconds == pytest.approx(load + compute / 32, rel=0.05)
    assert seconds < 0.25 * P.prefill_seconds(8001)  # far cheaper than computing the prompt again


def test_tier_moves_are_priced_by_the_profile_and_disk_stores_are_off_the_step(bundled_dir):
    engine = EngineCore(EngineConfig(model=str(bundled_dir), kv_cache_memory=64 * P.block_bytes, block_size=16,
                                     sim=P.sim_config()))
    r = engine.runner
    moves = [Move(Tier.HOST, True, 10, 1280, 0.0), Move(Tier.HOST, False, 5, 640, 0.0),
             Move(Tier.DISK, True, 2, 256, 0.0), Move(Tier.DISK, False, 100, 12800, 0.0)]
    assert r.tier_move_seconds(moves) == pytest.approx(15 * P.block_bytes / 50e9 + 2 * P.block_bytes / 6e9)


def test_write_through_stores_run_on_the_copy_engine_and_a_forward_reusing_blocks_waits_for_theirs(bundled_dir):
    pool = 64 * P.block_bytes
    config = dict(model=str(bundled_dir), kv_cache_memory=pool, block_size=16, sim=P.sim_config(speedup=1.0))
    engine = EngineCore(standin_tiers(EngineConfig(kv_offload_memory=8 * pool, **config)))
    r, off = engine.runner, engine.kv.tiers
    assert off is not None
    a, b = list(range(1000, 1000 + 60 * 16 + 1)), list(range(30000, 30000 + 60 * 16 + 1))
    step_s = run(EngineCore(EngineConfig(**config)), "a", a)[1]  # the same prompt without tiers
    block_s = P.block_bytes / 50e9
    # 10000 blocks' copies (0.42 s) ahead of a's on the copy engine
    off._record_move(Move(Tier.HOST, False, 10_000, 0, 0.0, batch=10**9))
    seen: list[Move] = []

    class Seen:  # tier_spec.TierObserver: the moves
        def moved(self, move): seen.append(move)
        def looked_up(self, queried_blocks, hits): pass
        def evicted(self, tier, blocks): pass
        def fault(self, tier, fault): pass

    off.observer = Seen()
    cached, seconds = run(engine, "a", a)  # 60 blocks written through, behind the backlog
    assert cached == 0 and sum(m.blocks for m in seen) == 60 and all(m.batch and not m.load for m in seen)
    assert seconds == pytest.approx(step_s, rel=1e-6)  # nothing waited for them
    cached, seconds = run(engine, "b", b)  # overwrites a's blocks: waits for their stores
    assert cached == 0 and seconds > step_s + 0.5 * 10_000 * block_s
    assert r.tier_move_seconds([Move(Tier.HOST, False, 10, 0, 0.0, batch=1)]) == pytest.approx(10 * block_s)
