"""Simulated nodes: the timing model, the SimRunner inside a real EngineCore (real
scheduler, block pool and prefix cache), a fleet of simulated nodes in one
process serving the real router and Redis through the openai client, and a
heterogeneous deployment (prefill nodes on the TP4 profile, decode nodes on the
TP8 one) whose nodes hold and time as their own profile says."""

import asyncio
import json
import os
import time
import urllib.request

import openai
import pytest

from splitserve.common.config import EngineConfig, SimConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore

os.environ.setdefault("SPLITSERVE_QUIET", "1")
MODEL = "SmolLM2-135M-Instruct"


def test_step_time_follows_the_fitted_formula():
    sim = SimConfig(step_s=0.01, prefill_token_s=0.001, prefill_attn_s=1e-6,
                    decode_s=((1, 0.02), (4, 0.05), (16, 0.11)))
    assert sim.step_seconds(0, [(100, 0)]) == pytest.approx(0.01 + 0.1 + 1e-6 * 100 * 50)
    assert sim.step_seconds(0, [(100, 400)]) == pytest.approx(0.01 + 0.1 + 1e-6 * 100 * 450)
    assert sim.step_seconds(4, []) == pytest.approx(0.06)
    assert sim.step_seconds(10, []) == pytest.approx(0.01 + 0.08)  # between 4 and 16
    assert sim.step_seconds(32, []) == pytest.approx(0.01 + 0.11 + 0.06 / 12 * 16)  # last slope
    assert sim.step_seconds(0, []) == pytest.approx(0.01)


def test_sim_config_loads_the_fit_and_rejects_nonsense(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"step_s": 0.5, "prefill_token_s": 0.002, "prefill_attn_s": 0,
                                "decode_s": [[1, 0.1], [8, 0.2]], "threads": 1}))
    sim = SimConfig.load(path, speedup=4)
    assert (sim.step_s, sim.decode_s, sim.speedup) == (0.5, ((1, 0.1), (8, 0.2)), 4)
    assert SimConfig.load(None) == SimConfig()
    with pytest.raises(ValueError, match="cannot read"):
        SimConfig.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="speedup"):
        SimConfig(speedup=0)
    with pytest.raises(ValueError, match="decode_s"):
        SimConfig(decode_s=((8, 0.1), (4, 0.2)))


def test_simulated_engine_runs_the_real_scheduler_and_prefix_cache(bundled_dir):
    sim = SimConfig(step_s=0.0, prefill_token_s=0.0001, prefill_attn_s=0.0, decode_s=((1, 0.002),), speedup=1)
    engine = EngineCore(EngineConfig(model=str(bundled_dir), kv_cache_memory=64 << 20, sim=sim,
                                     prefill_chunk_size=64))
    assert engine.runner.kv_caches.shape == (1, 2, engine.num_blocks, 16, 1, 1)
    prompt = list(range(1000, 1200))  # 200 tokens: 4 chunks of 64
    params = SamplingParams(max_tokens=5)
    engine.add_request("a", engine.prompt_ref(prompt), params)
    start, out = time.monotonic(), []
    while engine.has_unfinished():
        out += engine.step()
    elapsed = time.monotonic() - start
    tokens = [t for d in out for t in d.new_token_ids]
    assert len(tokens) == 5 and out[-1].finish_reason == "length"  # never an EOS
    assert not set(tokens) & set(engine.model_config.eos_token_ids)
    assert elapsed >= 200 * 0.0001 + 4 * 0.002 * 0.9  # it slept the model's time
    assert engine.num_computed_tokens_total == 200 + 4
    engine.add_request("b", engine.prompt_ref(prompt), params)  # the same prompt: its full blocks are cached
    first = []
    while not first:
        first = engine.step()
    assert first[0].num_cached_tokens == 192
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_free_blocks == engine.num_blocks  # nothing leaked


def test_fleet_serves_the_router_with_transfers_and_prefix_hits():
    from splitserve.deploy.launcher import SimCluster

    with SimCluster(2, 1, fleet_procs=1, sim_args=["--sim-speedup", "20"], kv_cache_memory="256MiB") as c:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="-", max_retries=0)
        prompt = list(range(2000, 2600))
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
        assert first.usage.completion_tokens == 8 and first.choices[0].finish_reason == "length"
        time.sleep(0.5)  # the index write and one node registry poll
        again = client.completions.create(model=MODEL, prompt=prompt + [7, 8, 9], max_tokens=4)
        assert again.usage.prompt_tokens_details.cached_tokens == 592
        with urllib.request.urlopen(f"{c.url}/debug/decisions?limit=2", timeout=10) as r:
            d = json.loads(r.read())["decisions"]
        # decode-side reuse: the decode node that holds the prompt computes the 3 new tokens itself
        assert (d[-1]["prefill"], d[-1]["decode"], d[-1]["reuse"]) == (None, d[-2]["decode"], "own")
        assert d[-1]["outcome"] == "hit"
        with urllib.request.urlopen(f"{c.url}/health", timeout=10) as r:
            health = json.loads(r.read())
        assert (health["prefill_nodes"], health["decode_nodes"]) == (2, 1)
        stream = client.completions.create(model=MODEL, prompt=prompt[:300], max_tokens=6, stream=True)
        assert sum(1 for _ in stream) >= 1


def test_fleet_configs_give_the_decode_nodes_their_own_template():
    from splitserve.common.config import NodeConfig
    from splitserve.deploy.planner.sim_profiles import get_deployment
    from splitserve.node.sim_fleet import fleet_configs

    d = get_deployment("llama3-70b-p-tp4-d-tp8-h100")
    make = lambda p: NodeConfig(role="decode", engine=EngineConfig(kv_cache_memory=p.kv_pool_bytes,
                                                                   sim=p.sim_config()))
    configs = fleet_configs(make(d.prefill), 2, 1, "het", decode_template=make(d.decode))
    assert [(c.role, c.node_id, c.engine.kv_cache_memory) for c in configs] == [
        ("prefill", "het-prefill-0", d.prefill.kv_pool_bytes), ("prefill", "het-prefill-1", d.prefill.kv_pool_bytes),
        ("decode", "het-decode-0", d.decode.kv_pool_bytes)]
    assert configs[2].engine.sim.roofline == d.decode.roofline != d.prefill.roofline
    assert {c.engine.kv_cache_memory for c in fleet_configs(make(d.prefill), 1, 1)} == {d.prefill.kv_pool_bytes}
    with pytest.raises(ValueError, match="no timing model"):
        fleet_configs(make(d.prefill), 1, 1, decode_template=NodeConfig(role="decode", engine=EngineConfig()))


async def _node_states(redis_url: str) -> dict[str, dict]:
    """role -> /debug/state of the one node of that role."""
    from splitserve.common.node_registry import NodeRegistry

    registry = NodeRegistry(redis_url)
    try:
        nodes = await registry.list_nodes()
    finally:
        await registry.close()
    states = {}
    for n in nodes:
        with urllib.request.urlopen(f"{n.http_addr}/debug/state", timeout=10) as r:
            states[n.role] = json.loads(r.read())
    return states


def test_heterogeneous_deployment_prefills_like_tp4_and_decodes_like_tp8():
    """Real fleet processes (one per role), a real router and Redis, in real time
    (speed-up 1): the prefill node's pool and forward time are the TP4 profile's,
    the decode node's the TP8 one's, and each is far from the other profile's."""
    from splitserve.benchmarks.loadgen.replay.cluster import DeploymentSimCluster
    from splitserve.deploy.planner.sim_profiles import get_deployment

    d = get_deployment("llama3-70b-p-tp4-d-tp8-h100")
    prompt, out = list(range(1000, 9000)), 48
    with DeploymentSimCluster(d, 1, 1, fleet_procs=1, sim_args=["--sim-speedup", "1"]) as c:
        assert sorted(p.args[p.args.index("--profile") + 1] for p in c.procs if p.role == "fleet") == [
            "llama3-70b-tp4-h100", "llama3-70b-tp8-h100"]  # one process per role, even with fleet_procs=1
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="-", max_retries=0)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=out)
        assert r.usage.completion_tokens == out and r.usage.prompt_tokens_details.cached_tokens == 0
        states = asyncio.run(_node_states(c.redis_url))
    pre, dec = states["prefill"], states["decode"]
    assert pre["kv_blocks_total"] == d.prefill.kv_pool_tokens // 16 == 28478  # 4 H100s after the weights
    assert dec["kv_blocks_total"] == d.decode.kv_pool_tokens // 16 == 83889  # 8 H100s after the weights
    # the decode node computed only the decode steps: the prompt's KV came from the prefill node
    assert pre["computed_tokens"] == len(prompt) and dec["computed_tokens"] == out - 1
    # forward-pass seconds (wall, slept as the roofline says) against each profile's own figure
    prefill = {p.name: p.prefill_seconds(len(prompt)) for p in (d.prefill, d.decode)}
    decode = {p.name: sum(p.sim_config().step_seconds(1, [], len(prompt) + k) for k in range(out - 1))
              for p in (d.prefill, d.decode)}
    assert 0.95 * prefill[d.prefill.name] < pre["busy_s"] < 1.3 * prefill[d.prefill.name]  # TP4: ~0.65 s
    assert pre["busy_s"] > 1.5 * prefill[d.decode.name]  # not TP8's ~0.33 s
    assert 0.95 * decode[d.decode.name] < dec["busy_s"] < 1.3 * decode[d.decode.name]  # TP8: ~0.56 s
    assert dec["busy_s"] < 0.8 * decode[d.prefill.name]  # not TP4's ~0.99 s
