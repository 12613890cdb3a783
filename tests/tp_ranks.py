"""Factories for tensor-parallel engine tests: a rank's group without processes (to build
and load one rank's shard in the test process), worker ranks started the way a node
starts them (``run_worker`` with a control that dumps the rank's KV blocks), engine
configs whose every rank holds the same number of KV blocks as a TP=1 engine, and the
scenario every TP test runs (shared prefixes, a second wave that hits the prefix cache,
a KV cache small enough to preempt)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch

from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.kv.sizing import kv_block_bytes
from splitserve.engine.models.families import read_model_config
from splitserve.engine.parallel.group import TPGroup, init_tp_group
from splitserve.engine.models.sharding import shard_of
from splitserve.engine.parallel.worker import TPRendezvous, run_worker


def fake_group(rank: int, size: int) -> TPGroup:
    """Rank ``rank`` of ``size`` for building and loading a shard in this process; any
    collective on it fails (no process group behind it)."""
    return TPGroup(rank, size, torch.device("cpu"), pg=object())


def tp_config(model_dir: Path, tp: int, blocks: int, **fields) -> EngineConfig:
    """fp32 CPU config of ``tp`` ranks whose KV cache holds ``blocks`` blocks per rank (as at
    TP=1: the same block ids, so the same schedule and preemptions)."""
    cfg = read_model_config(model_dir)
    bs = fields.pop("block_size", 8)
    heads = shard_of(cfg, 0, tp).num_kv_heads
    return EngineConfig(model=str(model_dir), tensor_parallel_size=tp, block_size=bs, dtype="float32",
                        kv_cache_memory=blocks * kv_block_bytes(cfg, bs, torch.float32, heads), **fields)


# Prompts of the scenario: 4 share a 26-token prefix (3 full blocks of 8), 2 others; a second wave
# repeats two of them after the first finished part of its work (prefix-cache hits).
PREFIX = [(7 * i + 3) % 250 + 1 for i in range(26)]
SCENARIO = {
    "a": PREFIX + [11, 12, 13],
    "b": PREFIX + [21, 22],
    "c": PREFIX + [31, 32, 33, 34, 35],
    "d": PREFIX + [41],
    "e": [(5 * i + 1) % 250 + 1 for i in range(19)],
    "f": [(11 * i + 2) % 250 + 1 for i in range(33)],
    "a2": PREFIX + [11, 12, 13],
    "c2": PREFIX + [31, 32, 33, 34, 35],
}
JOIN_AT = {"a2": 6, "c2": 9}  # steps at which the second wave joins
SCENARIO_BLOCKS = 12  # per rank: the first wave needs more, so the scheduler preempts (5 times at TP=1)


def scenario(max_tokens: int = 12) -> dict[str, tuple[list[int], SamplingParams]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return {rid: (ids, params) for rid, ids in SCENARIO.items()}


# ---- a worker rank started as a node would start it ------------------------------------------
def dump_worker(config: EngineConfig, rank: int, rendezvous: TPRendezvous, out_dir: str) -> None:
    """Run worker ``rank``; the control "dump" (payload: JSON block ids) saves this rank's KV
    of those blocks, ``[layers, 2, n, block_size, its kv heads, head_dim]``, and its heads."""
    state = {}

    def ready(runner) -> None:
        state["runner"] = runner

    def dump(payload: bytes) -> None:
        runner = state["runner"]
        ids = torch.tensor(json.loads(payload), dtype=torch.long)
        torch.save({"kv": runner.kv_caches[:, :, ids].clone(), "heads": tuple(runner.shard.kv_heads)},
                   Path(out_dir) / f"rank{rank}.pt")

    run_worker(config, rank, rendezvous, on_runner_built=ready, controls={"dump": dump})


def start_dump_workers(config: EngineConfig, rendezvous: TPRendezvous, out_dir: Path) -> list:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=dump_worker, args=(config, r, rendezvous, str(out_dir)), daemon=True)
             for r in range(1, rendezvous.size)]
    for p in procs:
        p.start()
    return procs


def gloo_peer(port: int, fault: str, q) -> None:
    """Rank 1 of a two-rank group whose rank 0 hosts the store on ``port``: runs the
    collectives rank 0 runs, reports its results on ``q``, then dies (``fault`` "kill") or
    hangs (``"hang"``: SIGSTOP, sockets left open)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    group = init_tp_group(1, 2, torch.device("cpu"), store, timeout_s=2)
    t = torch.full((4,), 2.0)
    group.all_reduce(t)
    q.put(("sum", t.tolist(), group.all_gather(torch.tensor([[1]]), dim=-1).tolist(), group.min_int(6)))
    q.close()
    q.join_thread()  # the report has left before the fault
    os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
