"""Tensor-parallel nodes end to end: real processes (redis-server, the router, prefill and
decode nodes whose rank 0 starts its worker ranks), gloo on the CPU, tiny random fp32
models with the bundled tokenizer.

- Greedy tokens through router -> prefill -> decode equal the TP=1 engine's for every P/D
  TP pair of {1, 2} (the router's round robin over 2 prefill and 3 decode nodes walks all
  six pairs), on a Llama-3 with 2 KV heads (TP=2 splits them, over tcp) and a Qwen3 with 1
  (TP=2 replicates it, over shm); each decision names the pair, no request fell back to a
  local prefill and every pool is free afterwards. Every layer's hidden states at TP=2 are
  within 1e-5 of TP=1's in tests/test_tp_engine.py; here the tokens are the check.
- Incompatible pairs: a decode node of another model, dtype and block size refuses to join
  the pool at start-up naming each field; a TP the KV heads cannot split is refused before
  any rank starts; an unregistered prefill node of another dtype is refused at the KV
  handshake and the decode node prefills itself: the tokens are still TP=1's.
- Failure is whole: kill -9 of one worker rank of the decode node (then of the prefill
  node) under load fails no request (migration on; the prefill node's decode peers prefill
  themselves), the broken node exits non-zero by itself, none of its processes is left
  after 30 s, its supervisor restarts it, and every node's pool is 100% free. A worker
  rank whose rank 0 is killed exits by itself.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import msgspec
import openai
import pytest

from splitserve.benchmarks.harness import MODEL, Outcome, run_load, wait_pools_free
from splitserve.common.auth import new_cluster_token
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.protocol import FrameReader, GenerateRequest, TokenDelta
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.launcher import Cluster, free_port

pytestmark = pytest.mark.slow
os.environ.setdefault("SPLITSERVE_QUIET", "1")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# name -> (family, config overrides, backend its cluster uses): 4 query heads each
MODELS = {
    "llama3-kv2": ("llama", dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE), "tcp"),
    "qwen3-kv1": ("qwen3", dict(num_key_value_heads=1), "shm"),
}
PREFILL_TP = (1, 2)  # prefill-0, prefill-1
DECODE_TP = (1, 2, 2)  # decode-0 .. decode-2: with 2 prefill nodes, round robin walks all 6 pairs
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served_model(served_tiny_model):
    """name -> a tiny random model folder over the bundled vocabulary, with its tokenizer."""
    def get(name):
        family, overrides, _ = MODELS[name]
        return served_tiny_model(family, max_position_embeddings=512, **overrides)
    return get


def prompts(n: int) -> list[list[int]]:
    """Distinct token prompts of 3-5 blocks of 16 (every pair sends blocks, none hits a cache)."""
    return [[(37 * i + 11 * j + 5) % 40000 + 100 for j in range(40 + 9 * i)] for i in range(n)]


def reference(model_dir, ids: list[list[int]]) -> list[str]:
    """The TP=1 engine's greedy texts."""
    from splitserve.engine.llm import LLM
    with LLM(str(model_dir), kv_cache_memory=16 << 20) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return [o.text for o in llm.generate(ids, params)]


def get_json(url: str, headers=None) -> dict:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def metric(addr: str, prefix: str) -> float:
    with urllib.request.urlopen(f"{addr}/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(prefix) and not line.startswith("#"))


def start_nodes(c: Cluster, prefill_tp, decode_tp, timeout: float = 180) -> None:
    """Redis, then one node per TP given (``<role>-<i>``), then the router; wait until it sees them all."""
    c.start_redis()
    procs = [c.start_node("prefill", i, ["--tensor-parallel-size", str(tp)]) for i, tp in enumerate(prefill_tp)]
    procs += [c.start_node("decode", i, ["--tensor-parallel-size", str(tp)]) for i, tp in enumerate(decode_tp)]
    procs += c.start_routers()
    for p in procs:
        c.wait_ready(p, timeout)
    c.wait_for_nodes(len(prefill_tp) + len(decode_tp), timeout)


@pytest.fixture(scope="module", params=sorted(MODELS))
def pairs_cluster(request, served_model):
    name = request.param
    path = served_model(name)
    c = Cluster(prefill_nodes=0, decode_nodes=0, kv_backend=MODELS[name][2], kv_cache_memory="8MiB",
                model=str(path), policy="round_robin")
    try:
        start_nodes(c, PREFILL_TP, DECODE_TP)
        yield name, path, c
    finally:
        c.stop()


def test_greedy_tokens_of_every_tp_pair_equal_tp1(pairs_cluster):
    name, path, c = pairs_cluster
    ids = prompts(6)
    want = reference(path, ids)
    client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=120)
    got = [client.completions.create(model=str(path), prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text for p in ids]
    decisions = get_json(f"{c.url}/debug/decisions?limit=6")["decisions"][-6:]
    tp = {f"prefill-{i}": t for i, t in enumerate(PREFILL_TP)} | {f"decode-{i}": t for i, t in enumerate(DECODE_TP)}
    pairs = [(tp[d["prefill"]], tp[d["decode"]]) for d in decisions]
    assert {(1, 2), (2, 1), (2, 2)} <= set(pairs), pairs
    for pair, g, w in zip(pairs, got, want):
        assert g == w, f"{name}: P/D TP {pair}: {g!r} != TP=1's {w!r}"
    decode_addrs = [c.node(f"decode-{i}").addr for i in range(len(DECODE_TP))]
    prefill_addrs = [c.node(f"prefill-{i}").addr for i in range(len(PREFILL_TP))]
    assert sum(metric(a, "splitserve:decode_fallback_prefills_total") for a in decode_addrs) == 0
    assert all(metric(a, "splitserve:kv_blocks_sent_total") > 0 for a in prefill_addrs)
    states = {a: get_json(f"{a}/debug/state") for a in decode_addrs + prefill_addrs}
    for a, st in states.items():  # the node's KV pool: every rank's bytes, each rank's heads
        ranks = st["kv_pool"]["ranks"]
        assert len(ranks) == st["tensor_parallel_size"] == st["kv"]["tp"] and len(st["worker_pids"]) == len(ranks) - 1
        assert st["kv_pool"]["bytes"] == sum(r["bytes"] for r in ranks)
    asyncio.run(wait_pools_free(decode_addrs + prefill_addrs, {}, 10))


def _node_cmd(c: Cluster, role: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "splitserve.cli", role, "--port", "0", "--kv-cache-memory", "8MiB",
            "--threads", "1", *c._model_args(), *args]


def test_incompatible_nodes_are_refused_and_nothing_is_garbage(pairs_cluster):
    name, path, c = pairs_cluster
    env = dict(os.environ, SPLITSERVE_REDIS_URL=c.redis_url, PYTHONUNBUFFERED="1")
    # a decode node of another model, dtype and block size: refused at start-up, naming each field
    out = subprocess.run(_node_cmd(c, "decode", "--served-model-name", "other", "--dtype", "bfloat16",
                                   "--block-size", "8", "--kv-backend", MODELS[name][2]),
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "cannot be exchanged with any registered prefill node" in out.stderr
    for field in ("model: 'other' != ", "dtype: 'bfloat16' != 'float32'", "block_size: 8 != 16"):
        assert field in out.stderr, out.stderr
    # a TP the model cannot split: refused before any rank starts
    t0 = time.monotonic()
    out = subprocess.run(_node_cmd(c, "prefill", "--tensor-parallel-size", "3"), capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 2 and "tensor_parallel_size: 3 does not divide" in out.stderr, out.stderr
    assert "workers rank" not in out.stderr  # refused before any worker started
    assert time.monotonic() - t0 < 60

    # An unregistered prefill node of another dtype, named to a decode node directly: the KV
    # handshake refuses it before a byte moves and the decode node prefills itself.
    bf16 = subprocess.Popen(_node_cmd(c, "prefill", "--dtype", "bfloat16", "--kv-backend", MODELS[name][2],
                                      "--tensor-parallel-size", "2"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={k: v for k, v in env.items() if k != "SPLITSERVE_REDIS_URL"},
                            start_new_session=True)
    try:
        lines = []
        for line in bf16.stdout:
            lines.append(line)
            if line.startswith("READY "):
                break
        assert lines and lines[-1].startswith("READY "), "".join(lines[-20:])
        prefill_addr = lines[-1].split()[1]
        ids = prompts(7)[-1]
        decode = c.node("decode-1").addr  # TP=2
        before = metric(decode, 'splitserve:decode_fallback_prefills_total{model_name="' + str(path)
                        + '",reason="transfer_failed"')
        tokens = _generate(decode, ids, prefill_addr)
        want = reference(path, [ids])[0]
        from transformers import AutoTokenizer
        assert AutoTokenizer.from_pretrained(path).decode(tokens) == want
        after = metric(decode, 'splitserve:decode_fallback_prefills_total{model_name="' + str(path)
                       + '",reason="transfer_failed"')
        assert after == before + 1
        assert get_json(f"{prefill_addr}/debug/state")["kv"]["dtype"] == "bfloat16"
    finally:
        os.killpg(bf16.pid, signal.SIGKILL)
        bf16.wait()


def _generate(decode_addr: str, ids: list[int], prefill_addr: str) -> list[int]:
    """Greedy tokens of one GenerateRequest sent straight to a decode node."""
    req = GenerateRequest(request_id=f"direct-{time.monotonic_ns()}", prompt=WirePrompt.of(ids),
                          sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                          prefill_addr=prefill_addr, transfer_id=f"t-{time.monotonic_ns()}")
    http = urllib.request.Request(f"{decode_addr}/generate", data=msgspec.msgpack.encode(req),
                                  headers={"Content-Type": "application/msgpack"})
    reader, tokens = FrameReader(TokenDelta), []
    with urllib.request.urlopen(http, timeout=60) as r:
        for delta in reader.feed(r.read()):
            assert delta.error is None, delta.error
            tokens += delta.token_ids
    return tokens


# ---- failure ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fault_cluster(served_model):
    """Supervised (as `up` runs it), with the cluster token and migration: prefill-0 TP=2,
    decode-0 TP=2, decode-1 TP=1 (where decode-0's streams migrate)."""
    c = Cluster(prefill_nodes=0, decode_nodes=0, kv_backend="shm", kv_cache_memory="8MiB",
                model=str(served_model("llama3-kv2")), served_model_names=[MODEL],
                cluster_token=new_cluster_token(), redis_password=new_cluster_token(),
                extra_node_args=["--transfer-lease", "8"], router_args=["--migration-limit", "2"])
    try:
        start_nodes(c, (2,), (2, 1))
        c.supervise()
        yield c
    finally:
        c.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_worker_under_load(c: Cluster, name: str, nodes=("prefill-0", "decode-0", "decode-1")) -> float:
    """SIGKILL worker rank 1 of node ``name`` while requests stream; what the router counted
    (migrations) meanwhile. Every request succeeds, the node exits by itself and comes back,
    and every node of ``nodes`` (the cluster's) is registered again with its pool free."""
    st = get_json(f"{c.node(name).addr}/debug/state", c.auth_headers())
    rank0, worker = st["pid"], st["worker_pids"]["1"]
    old = c.node(name).popen.pid
    prompt = ["Write a haiku about the sea.", "Name three colors of the rainbow.", "Explain rain to a child."]
    migrations = metric(c.url, "splitserve:request_migrations_total")

    def running() -> int:
        return get_json(f"{c.node(name).addr}/debug/state", c.auth_headers())["load"]["running"]

    async def scenario():
        load = asyncio.create_task(run_load(c.url, rate=3, duration_s=6, prompts=prompt, max_tokens=120))
        await asyncio.sleep(1)
        until = time.monotonic() + 4  # kill while the node runs requests (a slow machine starts them late)
        while await asyncio.to_thread(running) == 0 and time.monotonic() < until:
            await asyncio.sleep(0.1)
        os.kill(worker, signal.SIGKILL)
        return await load
    results = asyncio.run(scenario())
    failed = [r.error for r in results if r.outcome is not Outcome.OK]
    assert failed == [], failed
    deadline = time.monotonic() + 30
    while _alive(rank0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(rank0) and not _alive(worker), "a rank of the broken node is still running"
    assert c._supervisor is not None
    while (member := next(m for m in c._supervisor.status()["members"] if m["name"] == name))["last_exit"] is None:
        assert time.monotonic() < deadline + 5, member
        time.sleep(0.1)
    assert member["last_exit"] == 3, member  # it exited by itself, broken (not killed)
    t0 = time.monotonic()
    while not (c.node(name).popen.pid != old and c.node(name).ready.is_set()):
        assert time.monotonic() - t0 < 90, f"{name} did not come back:\n" + "\n".join(c.node(name).log[-20:])
        time.sleep(0.2)
    c.wait_for_nodes(len(nodes), 60)
    addrs = [c.node(n).addr for n in nodes]
    asyncio.run(wait_pools_free(addrs, c.auth_headers(), 20))
    assert get_json(f"{c.node(name).addr}/debug/state", c.auth_headers())["failure"] is None
    return metric(c.url, "splitserve:request_migrations_total") - migrations


def test_killed_decode_worker_rank_fails_no_request_and_the_node_comes_back(fault_cluster):
    assert kill_worker_under_load(fault_cluster, "decode-0") >= 1  # its streams moved to decode-1


def test_killed_prefill_worker_rank_fails_no_request_and_the_node_comes_back(fault_cluster):
    kill_worker_under_load(fault_cluster, "prefill-0")


def test_worker_rank_exits_when_its_rank0_is_killed(served_model):
    node = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "decode", "--port", str(free_port()),
                             "--model", str(served_model("llama3-kv2")), "--kv-cache-memory", "8MiB",
                             "--threads", "1", "--tensor-parallel-size", "2", "--kv-backend", "shm"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for line in node.stdout:
            if line.startswith("READY "):
                addr = line.split()[1]
                break
        else:
            raise AssertionError("the node did not start")
        worker = get_json(f"{addr}/debug/state")["worker_pids"]["1"]
        node.kill()  # SIGKILL, rank 0 only: its worker must notice by itself
        node.wait()
        deadline = time.monotonic() + 20
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the worker rank outlived its rank 0"
    finally:
        try:
            os.killpg(node.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.wait()
