"""Data-parallel attention (engine/ranks/data_parallel.py): a MoE node of N ranks, each its
own requests, scheduler and KV pool and a node of its pool, the experts split over the N and
the MoE layers run over every rank's tokens in lockstep. A tiny random DeepSeek-V3 (MLA's
latent KV cache, DeepSeekMoE) over the bundled vocabulary, real processes, Redis, fp32.

- Tokens: prefill ranks of a DP1 node and a DP2 node, decode ranks of two DP1 nodes and a DP2
  node, the router's round robin (3 prefill x 4 decode ranks) walking every (prefill DP,
  decode DP) layout of (1, 1), (2, 1), (1, 2), (2, 2): transformers' greedy tokens on each, the
  latent blocks sent from the rank that computed them to the rank that decodes (0 fallbacks).
- Balance and faults (supervised, as `up` runs it; migration on): under load the two ranks
  of a DP2 decode node hold KV within 20% of each other, 0 failed; kill -9 of one rank under
  load: 0 failed (its and its peer's streams migrate to a DP1 decode node), its peer exits by
  itself (a failed collective, no hang), no process of the node is left after 30 s, both
  come back and every pool is free.
- Refusals: a dense model, experts the ranks do not divide, DP with TP.
"""

import asyncio
import os
import signal
import time

import openai
import pytest
import torch

from splitserve.benchmarks.harness import MODEL, Outcome, run_load, wait_pools_free
from splitserve.common import metric_names as names
from splitserve.common.auth import new_cluster_token
from splitserve.common.config import EngineConfig
from splitserve.deploy.launcher import Cluster, free_port
from splitserve.engine.models.families import model_config
from splitserve.engine.models.sharding import check_model_tp
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.tests.test_deepseek import DS, NEW_TOKENS
from splitserve.tests.test_tp_cluster import _alive, get_json, metric

pytestmark = pytest.mark.slow
os.environ.setdefault("SPLITSERVE_QUIET", "1")

# member -> its data-parallel size and rank (None: a DP1 node)
PREFILL = {"prefill-0": None, "prefill-1": (2, 0), "prefill-2": (2, 1)}
DECODE = {"decode-0": None, "decode-1": (2, 0), "decode-2": (2, 1), "decode-3": None}


def _dp_flags(spec, port: int) -> list[str]:
    if spec is None:
        return []
    size, rank = spec
    return ["--data-parallel-size", str(size), "--data-parallel-rank", str(rank),
            "--data-parallel-address", f"127.0.0.1:{port}"]


@pytest.fixture(scope="module")
def model_path(served_tiny_model):
    return served_tiny_model("deepseek_v3", **DS)


def test_every_pd_dp_layout_generates_transformers_tokens(model_path, hf_greedy):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompts = [[(37 * i + 11 * j + 5) % 40000 + 100 for j in range(20 + 7 * i)] for i in range(12)]
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    tok = RouterTokenizer(model_path)
    c = Cluster(prefill_nodes=0, decode_nodes=0, kv_backend="tcp", kv_cache_memory="8MiB", model=str(model_path),
                policy="round_robin")
    ports = {"prefill": free_port(), "decode": free_port()}
    try:
        c.start_redis()
        procs = [c.start_node(role, int(name.rsplit("-", 1)[1]), _dp_flags(spec, ports[role]))
                 for role, members in (("prefill", PREFILL), ("decode", DECODE)) for name, spec in members.items()]
        procs += c.start_routers()
        for p in procs:
            c.wait_ready(p, 180)
        c.wait_for_nodes(len(PREFILL) + len(DECODE), 180)
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=120)
        got = [client.completions.create(model=str(model_path), prompt=p, max_tokens=NEW_TOKENS, temperature=0,
                                         logprobs=0).choices[0].logprobs.tokens for p in prompts]
        decisions = get_json(f"{c.url}/debug/decisions?limit=12")["decisions"][-12:]
        dp = {name: 1 if spec is None else spec[0] for name, spec in {**PREFILL, **DECODE}.items()}
        layouts = [(dp[d["prefill"]], dp[d["decode"]]) for d in decisions]
        assert {(1, 1), (2, 1), (1, 2), (2, 2)} <= set(layouts), layouts
        for layout, g, w in zip(layouts, got, want):
            assert g == [tok.token_text(t) for t in w], f"P/D DP {layout}"
        addrs = {name: c.node(name).addr for name in (*PREFILL, *DECODE)}
        assert sum(metric(addrs[n], names.FALLBACK_PREFILLS) for n in DECODE) == 0
        assert all(metric(addrs[n], names.KV_BLOCKS_SENT) > 0 for n in PREFILL)  # every prefill rank sent latents
        for name, spec in {**PREFILL, **DECODE}.items():
            st = get_json(f"{addrs[name]}/debug/state")
            assert st["data_parallel"] == ({"rank": 0, "size": 1} if spec is None
                                           else {"rank": spec[1], "size": spec[0]}), st
            assert st["kv"]["latent_dim"] == 48
        asyncio.run(wait_pools_free(list(addrs.values()), {}, 20))
    finally:
        c.stop()


@pytest.fixture(scope="module")
def dp_cluster(model_path):
    """Supervised (as `up` runs it), cluster token and migration: one prefill node, a decode node
    of 2 data-parallel ranks (decode-0, decode-1) and a DP1 decode node (decode-2: where the
    streams of a broken node migrate), the router's default policy."""
    c = Cluster(prefill_nodes=0, decode_nodes=0, kv_backend="shm", kv_cache_memory="8MiB", model=str(model_path),
                served_model_names=[MODEL], cluster_token=new_cluster_token(), redis_password=new_cluster_token(),
                extra_node_args=["--transfer-lease", "8"],
                # placement over the ranks by load is the subject: decode-side reuse keeps a repeated
                # prompt on the rank that holds it
                router_args=["--migration-limit", "2", "--score-weights", "local_prefill_tokens=0"])
    port = free_port()
    try:
        c.start_redis()
        procs = [c.start_node("prefill", 0), c.start_node("decode", 2)]
        procs += [c.start_node("decode", r, _dp_flags((2, r), port)) for r in range(2)]
        procs += c.start_routers()
        for p in procs:
            c.wait_ready(p, 180)
        c.wait_for_nodes(4, 180)
        c.supervise()
        yield c
    finally:
        c.stop()


# Many prompts that differ in their first words: when the ranks are equally loaded (requests
# that do not overlap on a quiet machine) the router breaks the tie by the hash of the prompt's
# last full block, so a few prompts (or many alike up to there) would go to the same ranks
# every time.
PROMPTS = [f"{topic}: {task}." for task in ("write a haiku about it", "explain it to a child", "name three facts")
           for topic in ("Sea", "Rain", "Moon", "Bread", "Trains", "Winter", "Bees", "Rivers")]


def test_both_ranks_carry_the_load(dp_cluster):
    c = dp_cluster
    ranks = ("decode-0", "decode-1")
    usage: dict[str, list[float]] = {r: [] for r in ranks}

    async def scenario():
        # requests that overlap: the ranks share the load by what runs on each, not by tie-breaks
        load = asyncio.create_task(run_load(c.url, rate=4, duration_s=8, prompts=PROMPTS, max_tokens=200))
        while not load.done():
            for r in ranks:
                st = await asyncio.to_thread(get_json, f"{c.node(r).addr}/debug/state", c.auth_headers())
                usage[r].append(1 - st["kv_blocks_free"] / st["kv_blocks_total"])
            await asyncio.sleep(0.25)
        return await load
    results = asyncio.run(scenario())
    assert [r.error for r in results if r.outcome is not Outcome.OK] == []
    mean = {r: sum(u) / len(u) for r, u in usage.items()}
    assert min(mean.values()) > 0, mean
    assert abs(mean[ranks[0]] - mean[ranks[1]]) <= 0.2 * max(mean.values()), mean


def test_killed_rank_fails_no_request_and_the_node_comes_back(dp_cluster):
    c = dp_cluster
    victim, peer = "decode-1", "decode-0"
    pids = {n: get_json(f"{c.node(n).addr}/debug/state", c.auth_headers())["pid"] for n in (victim, peer)}
    old = {n: c.node(n).popen.pid for n in (victim, peer)}

    async def scenario():
        load = asyncio.create_task(run_load(c.url, rate=3, duration_s=6, prompts=PROMPTS, max_tokens=120))
        await asyncio.sleep(2)
        os.kill(pids[victim], signal.SIGKILL)
        return await load
    results = asyncio.run(scenario())
    failed = [r.error for r in results if r.outcome is not Outcome.OK]
    assert failed == [], (failed, "\n".join(c.node(peer).log[-40:]))
    assert metric(c.url, "splitserve:request_migrations_total") >= 1  # the broken node's streams moved
    deadline = time.monotonic() + 30
    while _alive(pids[peer]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pids[peer]) and not _alive(pids[victim]), "a rank of the broken node is still running"
    t0 = time.monotonic()
    for n in (victim, peer):
        while not (c.node(n).popen.pid != old[n] and c.node(n).ready.is_set()):
            assert time.monotonic() - t0 < 120, f"{n} did not come back:\n" + "\n".join(c.node(n).log[-20:])
            time.sleep(0.2)
    c.wait_for_nodes(4, 60)
    addrs = [c.node(n).addr for n in ("prefill-0", peer, victim, "decode-2")]
    asyncio.run(wait_pools_free(addrs, c.auth_headers(), 20))
    client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=60)
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4).choices[0].text is not None


def test_refusals_name_the_field(tiny_model_dir):
    dense = model_config(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
                              intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2))
    with pytest.raises(ValueError, match="data_parallel_size: .* dense model"):
        check_model_tp(dense, 1, dp=2)
    ds = model_config(dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=64, hidden_size=32,
                           intermediate_size=64, num_attention_heads=4, **DS))
    check_model_tp(ds, 1, dp=2)
    with pytest.raises(ValueError, match="data_parallel_size: 3 ranks do not divide the model's 8 experts"):
        check_model_tp(ds, 1, dp=3)
    with pytest.raises(ValueError, match="data_parallel_size: a data-parallel rank runs tensor_parallel_size 1"):
        EngineConfig(tensor_parallel_size=2, data_parallel_size=2, data_parallel_address="127.0.0.1:1")
    with pytest.raises(ValueError, match="data_parallel_address"):
        EngineConfig(data_parallel_size=2)
