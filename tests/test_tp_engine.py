"""Tensor parallelism end to end on the CPU: real worker processes, gloo collectives, the zmq
step channel. Each TP engine runs the scenario of tests/tp_ranks.py (shared prefixes,
prefix-cache hits, preemptions, chunked prefill, static decode buckets) on tiny random
fp32 models and is compared with the TP=1 engine on the same model:

- greedy tokens equal;
- every layer's output (the residual stream, which every rank holds after its all-reduce)
  within HIDDEN_RTOL of TP=1's, step by step: the only difference is the order in which
  the row-parallel partial sums are added;
- each rank's KV cache equals its heads of the TP=1 cache (workers started as a node
  starts them, dumping through a Control message);
- failures are bounded: a worker killed mid-generation, a worker stopped (hung), a worker
  that cannot start, rank 0 killed."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.llm import LLM
from splitserve.engine.parallel.group import TPFailure
from splitserve.engine.ranks.launch import TPLeader
from splitserve.tests.tp_ranks import JOIN_AT, SCENARIO_BLOCKS, scenario, start_dump_workers, tp_config

pytestmark = pytest.mark.slow

HIDDEN_RTOL = 1e-5  # max |TP - TP1| / max |TP1| per layer output, fp32
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# name -> (family, config overrides); all have 4 query heads
MODELS = {
    "llama3": ("llama", dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "qwen3-kv1": ("qwen3", dict(num_key_value_heads=1)),
    "qwen3-kv2": ("qwen3", dict(num_key_value_heads=2)),
    "qwen2": ("qwen2", dict(num_key_value_heads=2)),  # q/k/v biases, sharded with their rows
}
ENGINE = dict(max_num_seqs=8, prefill_chunk_size=16)


@pytest.fixture(scope="module")
def model_dir(shared_tiny_model):
    def get(name):
        family, overrides = MODELS[name]
        return shared_tiny_model(family, **overrides)
    return get


def _hidden_states(engine) -> list[list[torch.Tensor]]:
    """Per forward pass, every layer's output on rank 0 (recorded by hooks)."""
    passes: list[list[torch.Tensor]] = []
    layers = engine.runner.model.layers

    def first(_module, _args):
        passes.append([])

    def record(_module, _args, output):
        passes[-1].append(output.detach().clone())

    layers[0].register_forward_pre_hook(first)
    for layer in layers:
        layer.register_forward_hook(record)
    return passes


class Run:
    """The scenario run on ``engine`` (driven by conftest's ``drive_engine``) and what it left."""

    def __init__(self, engine, drive):
        self.hidden = _hidden_states(engine)
        requests = scenario()
        self.tokens: dict[str, list[int]] = {rid: [] for rid in requests}
        self.cached: dict[str, int] = {}
        for d in drive(engine, requests, JOIN_AT):
            self.tokens[d.request_id].extend(d.new_token_ids)
            self.cached[d.request_id] = d.num_cached_tokens
        self.preemptions = engine.num_preemptions_total
        self.kv = engine.runner.kv_caches[:, :, : engine.num_blocks].clone()


@pytest.fixture(scope="module")
def reference(model_dir, drive_engine):
    """name, load_format -> the TP=1 engine's Run (made once per module)."""
    runs: dict[tuple[str, str], Run] = {}

    def get(name, load_format="auto"):
        if (name, load_format) not in runs:
            cfg = tp_config(model_dir(name), 1, SCENARIO_BLOCKS, load_format=load_format, **ENGINE)
            runs[name, load_format] = Run(EngineCore(cfg), drive_engine)
        return runs[name, load_format]
    return get


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _check_against(run: Run, ref: Run, hidden: bool = True) -> None:
    assert run.tokens == ref.tokens
    assert run.cached == ref.cached and max(ref.cached.values()) > 0, "prefix-cache hits, as at TP=1"
    assert run.preemptions == ref.preemptions > 0, "the same preemptions as at TP=1"
    if hidden:
        assert len(run.hidden) == len(ref.hidden) > 0
        worst = max(_rel_diff(a, b) for pa, pb in zip(run.hidden, ref.hidden) for a, b in zip(pa, pb))
        print(f"largest relative difference of a layer's output from TP=1: {worst:.2e}")
        assert worst <= HIDDEN_RTOL, f"a layer's output differs from TP=1 by {worst:.2e} (relative)"


@pytest.mark.parametrize("name, tp, load_format, async_scheduling", [
    ("llama3", 2, "auto", False),  # 2 KV heads over 2 ranks: one each
    ("llama3", 4, "auto", False),  # 2 KV heads over 4 ranks: each held by 2 ranks
    ("llama3", 2, "auto", True),  # sampled ids broadcast to the workers for the next step's rows
    ("qwen3-kv1", 2, "auto", False),  # 1 KV head, replicated; q/k norms
    ("qwen3-kv2", 2, "auto", False),
    ("qwen2", 2, "auto", False),
    ("llama3", 2, "dummy", False),  # dummy weights: TP=2 is the TP=1 dummy model, sharded
])
def test_tp_engine_equals_tp1(model_dir, reference, drive_engine, name, tp, load_format, async_scheduling):
    ref = reference(name, load_format)
    cfg = tp_config(model_dir(name), tp, SCENARIO_BLOCKS, load_format=load_format,
                    async_scheduling=async_scheduling, **ENGINE)
    cores = os.sched_getaffinity(0)
    engine = EngineCore(cfg)
    try:
        assert engine.num_blocks == SCENARIO_BLOCKS
        run = Run(engine, drive_engine)
    finally:
        engine.close()
    _check_against(run, ref, hidden=not async_scheduling)
    assert os.sched_getaffinity(0) == cores, "close() gives rank 0's process its cores back"
    assert engine.tp is not None and all(p.exitcode == 0 for p in engine.tp.procs.values()), "Stop ends each worker"


def test_each_rank_holds_its_heads_of_every_block(model_dir, reference, drive_engine, tmp_path):
    """Workers started by the caller (as a node starts them) with a Control handler: each
    rank's KV cache is its heads of the TP=1 cache, block for block."""
    ref = reference("llama3")
    cfg = tp_config(model_dir("llama3"), 2, SCENARIO_BLOCKS, **ENGINE)
    leader = TPLeader(2)
    procs = start_dump_workers(cfg, leader.rendezvous, tmp_path)
    engine = EngineCore(cfg, tp=leader)
    try:
        run = Run(engine, drive_engine)
        leader.send_control("dump", json.dumps(list(range(engine.num_blocks))).encode())
    finally:
        engine.close()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    _check_against(run, ref, hidden=False)
    shards = {0: (run.kv, tuple(engine.runner.shard.kv_heads))}
    dump = torch.load(tmp_path / "rank1.pt")
    shards[1] = (dump["kv"], dump["heads"])
    assert [heads for _, heads in shards.values()] == [(0, 1), (1, 2)]
    for kv, (start, stop) in shards.values():
        want = ref.kv[:, :, :, :, start:stop]
        assert kv.shape == want.shape
        torch.testing.assert_close(kv, want, rtol=1e-4, atol=1e-5)


def test_worker_that_cannot_start_fails_rank0_with_its_error(model_dir, tmp_path):
    cfg = tp_config(model_dir("llama3"), 2, SCENARIO_BLOCKS, **ENGINE)
    leader = TPLeader(2, timeout_s=20)
    bad = dataclasses.replace(cfg, model=str(tmp_path / "no-such-model"))
    procs = start_dump_workers(bad, leader.rendezvous, tmp_path)
    t0 = time.monotonic()
    with pytest.raises(TPFailure) as e:
        EngineCore(cfg, tp=leader)
    assert time.monotonic() - t0 < 30
    assert "rank 1 reported: ValueError: model:" in str(e.value) and "no-such-model" in str(e.value)
    procs[0].join(timeout=10)
    assert procs[0].exitcode not in (None, 0)


def _long_requests(engine, n=4, max_tokens=180):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"long-{i}", engine.prompt_ref([(3 * j + i) % 250 + 1 for j in range(20)]), params)


def test_hung_worker_fails_rank0_after_the_collective_timeout(model_dir):
    cfg = tp_config(model_dir("llama3"), 2, SCENARIO_BLOCKS * 4, **ENGINE)
    leader = TPLeader(2, timeout_s=3)
    leader.spawn_workers(cfg)
    engine = EngineCore(cfg, tp=leader)
    worker = leader.procs[1]
    try:
        _long_requests(engine)
        engine.step()
        os.kill(worker.pid, signal.SIGSTOP)  # alive, sockets open, answering nothing
        t0 = time.monotonic()
        with pytest.raises(TPFailure, match="timeout 3 s"):
            while engine.has_unfinished():
                engine.step()
        waited = time.monotonic() - t0
        assert 2.5 <= waited <= 15, waited
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        engine.close()


def test_llm_tp2_equals_tp1_then_a_killed_worker_fails_generate(model_dir):
    """LLM(tensor_parallel_size=2) generates TP=1's greedy tokens; kill -9 of its worker in the
    middle of a generation makes generate raise, naming the rank and the signal, within seconds."""
    path = str(model_dir("qwen3-kv2"))
    prompts = [[5, 6, 7, 8, 9, 10], [200, 100, 50], list(range(1, 40))]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    with LLM(path, kv_cache_memory=1 << 20) as llm1:
        want = [o.token_ids for o in llm1.generate(prompts, params)]
    llm = LLM(path, tensor_parallel_size=2, kv_cache_memory=1 << 20)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        worker = llm.engine.tp.procs[1]
        killed_at: list[float] = []
        start = llm.engine.num_computed_tokens_total

        def kill():
            deadline = time.monotonic() + 60
            while llm.engine.num_computed_tokens_total < start + 100 and time.monotonic() < deadline:
                time.sleep(0.001)
            killed_at.append(time.monotonic())
            os.kill(worker.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill)
        killer.start()
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        with pytest.raises(TPFailure) as e:
            llm.generate([[(3 * j + i) % 250 + 1 for j in range(20)] for i in range(4)], long)
        failed_after = time.monotonic() - killed_at[0]
        killer.join()
    finally:
        llm.close()
    assert failed_after < 10, failed_after
    assert "rank 1" in str(e.value) and "SIGKILL" in str(e.value)


RANK0 = """
import sys, time
from splitserve.engine.llm import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_memory=1 << 20)
print(llm.engine.tp.procs[1].pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def test_worker_exits_when_rank0_is_killed(model_dir):
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0, str(model_dir("llama3"))], stdout=subprocess.PIPE,
                             text=True)
    try:
        line = rank0.stdout.readline() if rank0.stdout else ""
        assert line.strip().isdigit(), f"rank 0 did not start: {line!r}"
        worker = int(line)
        assert not _gone(worker)
        rank0.kill()
        rank0.wait()
        deadline = time.monotonic() + 20
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker), "the worker outlived rank 0"
    finally:
        rank0.kill()
        rank0.wait()


def test_engine_thread_stops_for_good_when_a_rank_dies(model_dir):
    """On a node's EngineThread a dead rank is fatal: the running request ends with "error",
    on_fatal gets the TPFailure, and a later command fails with it instead of hanging."""
    import asyncio

    from splitserve.engine.engine_thread import AddRequest, EngineThread

    engine = EngineCore(tp_config(model_dir("llama3"), 2, SCENARIO_BLOCKS * 4, **ENGINE))
    assert engine.tp is not None
    worker = engine.tp.procs[1]
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        loop = asyncio.get_running_loop()
        deltas: list = []
        fatal: asyncio.Future = loop.create_future()
        et = EngineThread(engine, loop, deltas.extend, on_fatal=fatal.set_result)
        et.start()
        try:
            await et.submit(AddRequest("r", engine.prompt_ref(list(range(1, 21))), params=long))
            while not deltas:
                await asyncio.sleep(0.01)
            os.kill(worker.pid, signal.SIGKILL)
            error = await asyncio.wait_for(fatal, 15)
            assert isinstance(error, TPFailure) and "SIGKILL" in str(error)
            await asyncio.sleep(0.1)  # the error delta, queued before on_fatal, has run
            assert deltas[-1].request_id == "r" and deltas[-1].finish_reason == "error"
            with pytest.raises(TPFailure):
                await et.submit(AddRequest("s", engine.prompt_ref([1, 2, 3]), params=long))
        finally:
            et.stop()

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_a_worker_the_node_started_exiting_before_hello_fails_rank0_at_once(model_dir):
    """A node watches the workers it starts (``TPLeader(dead=...)``): one that exits before it
    connects ends rank 0's wait at once, not after the 600 s start-up timeout."""
    import multiprocessing as mp

    procs: list = []
    leader = TPLeader(2, dead=lambda: next((f"rank 1 exited with {p.exitcode}" for p in procs
                                            if p.exitcode is not None), None))
    proc = mp.get_context("spawn").Process(target=os._exit, args=(7,))
    procs.append(proc)
    proc.start()
    t0 = time.monotonic()
    with pytest.raises(TPFailure, match="rank 1 exited with 7"):
        EngineCore(tp_config(model_dir("llama3"), 2, SCENARIO_BLOCKS, **ENGINE), tp=leader)
    assert time.monotonic() - t0 < 20
