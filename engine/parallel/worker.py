"""A worker rank of a tensor-parallel node: join the group, load this rank's shard, then
run every step rank 0 sends until it says stop or goes away.

Owns ``run_worker`` (the loop) and ``TPRendezvous`` (where a node's ranks find each
other). Must not: schedule, sample, own block ids or know about HTTP and transfers;
the node's code reaches a worker through ``on_runner_built`` (this rank's runner: its KV
cache, its heads) and ``controls`` (instructions rank 0 sends between steps).

A worker's life (rank 0's side of each step: parallel/launch.py, model_runner.py)::

    connect the step channel, RankHello        rank 0 waits for every RankHello
    join the TP group (TCPStore at rank 0)     gloo on the CPU, NCCL on CUDA
    on the CPU: pin to its share of the cores  parallel.pin_process
    ModelRunner over its shard                 load its slices; KV cache sized with the
                                               group (same block count); static decode
                                               buckets (CUDA graphs captured together)
    on_runner_built(runner)                    node: its KV store / receiver over runner.kv_caches
    loop: ForwardInputs -> runner.follow       the same forward as rank 0, in lockstep
          Control(kind, payload) -> controls[kind](payload)
          Stop -> return
    rank 0 gone (channel closed)     -> raises StepChannelClosed
    a collective failed or timed out -> raises CollectiveError
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import timedelta

import msgspec
import torch

from ...common.config import EngineConfig
from ..models.loader import resolve_model_dir
from ..model_runner import KVCacheFactory, ModelRunner
from .group import (DEFAULT_TIMEOUT_S, INIT_TIMEOUT_S, init_tp_group, pin_process, rank_cpus, rank_device,
                       rank_threads)
from ..step_inputs import ForwardInputs
from .step_channel import Control, StepReceiver

log = logging.getLogger(__name__)


class TPRendezvous(msgspec.Struct, frozen=True, kw_only=True):
    """Where one node's ranks find each other; rank 0 hosts both ends (launch.TPLeader).
    A msgspec struct: it pickles for a spawned worker and encodes for a command line."""

    size: int  # ranks of the node
    host: str = "127.0.0.1"  # the ranks' host: the store, and where each rank's gloo listens
    store_port: int  # torch.distributed TCPStore (rank 0 is its server)
    step_addr: str  # zmq endpoint of rank 0's StepSender
    timeout_s: float = DEFAULT_TIMEOUT_S  # every collective of a step
    init_timeout_s: float = INIT_TIMEOUT_S  # joining, and the first collective after loading


# node code on a worker: (payload) -> None, run between steps, on the worker's main thread
ControlHandler = Callable[[bytes], None]


def run_worker(config: EngineConfig, rank: int, rendezvous: TPRendezvous, *,
               device: torch.device | str | None = None, kv_cache_factory: KVCacheFactory | None = None,
               on_runner_built: Callable[[ModelRunner], None] | None = None,
               controls: Mapping[str, ControlHandler] | None = None) -> None:
    """Serve as rank ``rank`` (>= 1) of the node at ``rendezvous`` until rank 0 sends Stop
    (returns) or fails (raises a ``TPFailure``). ``config``: the node's config, the same
    as rank 0's. ``device``: this rank's (default ``parallel.rank_device``).
    ``kv_cache_factory`` places this rank's KV cache (shared memory for a same-host
    transport), ``on_runner_built`` gets the runner once built (its ``kv_caches`` and ``shard``),
    ``controls`` handle rank 0's ``Control`` messages by kind."""
    assert 1 <= rank < rendezvous.size, f"worker rank {rank} of {rendezvous.size}"
    dev = torch.device(device) if device is not None else rank_device(config.device, rank)
    threads = rank_threads(config.num_threads, rendezvous.size, dev)
    if threads:
        torch.set_num_threads(threads)
    channel = StepReceiver(rendezvous.step_addr, rank)
    group = None
    try:
        try:
            import torch.distributed as dist

            store = dist.TCPStore(rendezvous.host, rendezvous.store_port, rendezvous.size, False,
                                  timedelta(seconds=rendezvous.init_timeout_s))
            group = init_tp_group(rank, rendezvous.size, dev, store, host=rendezvous.host,
                                  timeout_s=rendezvous.timeout_s, expert_parallel=config.enable_expert_parallel)
            cpus = rank_cpus(rank, rendezvous.size, dev)
            if cpus is not None:
                pin_process(cpus)  # the group's threads exist now: they move too
            runner = ModelRunner(config, resolve_model_dir(config.model), kv_cache_factory, group)
            if on_runner_built is not None:
                on_runner_built(runner)
        except Exception as e:
            channel.report_failure(f"{type(e).__name__}: {e}")
            raise
        log.info("tensor-parallel rank %d of %d ready on %s: KV heads [%d, %d), %d blocks", rank,
                 rendezvous.size, dev, runner.shard.kv_heads.start, runner.shard.kv_heads.stop, runner.num_blocks)
        handlers = dict(controls or {})
        while True:
            msg = channel.recv()
            if isinstance(msg, ForwardInputs):
                runner.follow(msg)
            elif isinstance(msg, Control):
                handler = handlers.get(msg.kind)
                assert handler is not None, f"rank {rank} has no handler for control {msg.kind!r}"
                handler(msg.payload)
            else:  # Stop
                return
    finally:
        if group is not None:
            group.close()
        channel.close()
