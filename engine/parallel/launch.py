"""Rank 0's side of a tensor-parallel node: it hosts the rendezvous, joins the group and
sends each step to the workers (``TPLeader``); for offline use it also starts the
workers as child processes (``TPLeader.spawn_workers``: what ``LLM(...,
tensor_parallel_size=2)`` runs).

Owns who creates what. Must not: load the model (ModelRunner does, on every rank) or
know how a node supervises its processes (node/ and deploy/ do).

::

    rank 0 (EngineCore)                              worker r (worker.run_worker)
    leader = TPLeader(size)   TCPStore server, StepSender bound
    [leader.spawn_workers(config)] --- or the node starts each worker with leader.rendezvous ---
    EngineCore(config, tp=leader):
      leader.join(device)     waits for RankHellos   <-- RankHello       (connect)
                              init_tp_group           <-> init_tp_group   (TCPStore)
      ModelRunner(group, link=leader)                 ModelRunner(group)  (shards; KV sizing agrees)
    each step: leader.send_step(inputs) ------------> runner.follow(inputs)
    leader.send_control(kind, payload) ------------> controls[kind](payload), between the steps
    engine.close() -> leader.close(): Stop --------> returns; spawned workers joined (killed if stuck)

A failure of any rank reaches rank 0 as a ``TPFailure`` from the engine's step;
``leader.explain`` words it: which rank, its exit code or signal when this leader
started it, and what it reported.

A node (its rank 0 process) starting its own ranks, e.g. under its supervisor::

    leader = TPLeader(n, dead=...)                      # before the engine: ports are bound
    start ranks 1..n-1 with (config, rank, leader.rendezvous)   # each: run_worker(...)
    engine = EngineCore(config, factory, tp=leader)     # dead() names an exited worker: fail fast
    ... EngineThread(engine, ..., on_fatal=exit the node) ...
    engine.close()                                       # after the engine thread stopped

KV transfer per rank is the node's code; the engine's seams for it:

- Every rank's ``ModelRunner`` has ``kv_caches`` (``[layers, 2, blocks + 1, block_size,
  its KV heads, head_dim]``: its heads of every block, under rank 0's block ids) and
  ``shard.kv_heads`` (which global heads: ``common.kv_heads.rank_heads``). Rank 0's is
  ``engine.runner`` (read before the engine goes to its thread, as NodeRuntime does);
  a worker's is handed to ``run_worker(on_runner_built=...)``, where the node builds that rank's
  block store, sender and receiver.
- Import (decode node): each rank's receiver lands its heads into blocks rank 0 reserved
  (``Reserve`` on rank 0); no step is involved. Workers report landed blocks to rank 0
  over the node's rank pipe (kvtransfer/rank_report.py), not this one: a step channel's
  socket belongs to its worker's main thread.
- Export (prefill node): rank 0's EngineThread calls its exporter's ``pack(export, src_ids,
  dest_ids)`` (engine/block_export.py) right after launching the step that completed those
  blocks (``on_launch``), and a newly admitted request's cached prefix just before its first
  forward is queued (``on_kv_in_place``, after that step's inputs went out); the node's
  pack also calls ``leader.send_control("kv_export", payload)`` naming the blocks. Each
  worker runs ``controls["kv_export"](payload)`` after that step's forward and before the
  next one, so the blocks are still intact there (a block freed by rank 0 is written
  again only by a later step), and packs its own heads of them for its own sender.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess

import torch

from ...common.config import EngineConfig
from .group import DEFAULT_TIMEOUT_S, INIT_TIMEOUT_S, TPFailure, TPGroup, init_tp_group
from ..step_inputs import ForwardInputs
from .step_channel import Control, StepChannelClosed, StepSender, Stop
from .worker import TPRendezvous, run_worker

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # close(): how long a stopped worker gets to exit before it is killed


class TPLeader:
    """Rank 0's end of a node's ranks. Create it before the engine (the workers need its
    ``rendezvous``), hand it to ``EngineCore(config, tp=leader)``, and use it from the
    engine thread only (``send_control`` from a BlockExporter's pack, for instance)."""

    def __init__(self, size: int, *, host: str = "127.0.0.1", store_port: int = 0, step_port: int = 0,
                 timeout_s: float = DEFAULT_TIMEOUT_S, init_timeout_s: float = INIT_TIMEOUT_S,
                 dead: Callable[[], str | None] | None = None):
        """Host the rendezvous on ``host`` (ports 0: free ones, read back in ``rendezvous``).
        ``dead()``: for workers the node starts itself, what happened to one that exited (or
        None), so rank 0 stops waiting for it at once rather than after ``init_timeout_s``."""
        import torch.distributed as dist

        assert size >= 2, "a TP leader leads at least one worker"
        self.size = size
        self.store = dist.TCPStore(host, store_port, size, True, timedelta(seconds=init_timeout_s),
                                   wait_for_workers=False)
        self.channel = StepSender(size, f"tcp://{host}:{step_port or '*'}")
        self.rendezvous = TPRendezvous(size=size, host=host, store_port=self.store.port,
                                       step_addr=self.channel.addr, timeout_s=timeout_s,
                                       init_timeout_s=init_timeout_s)
        self.group: TPGroup | None = None
        self.procs: dict[int, BaseProcess] = {}  # rank -> the worker this leader started
        self.dead = dead
        self._closed = False

    def spawn_workers(self, config: EngineConfig) -> None:
        """Start ranks 1 .. size-1 as child processes (multiprocessing spawn: CUDA-safe, no
        inherited threads), daemonic so they never outlive this process."""
        ctx = mp.get_context("spawn")
        for rank in range(1, self.size):
            proc = ctx.Process(target=_spawned_worker, args=(config, rank, self.rendezvous),
                               name=f"splitserve-tp{rank}", daemon=True)
            proc.start()
            self.procs[rank] = proc

    def join(self, device: torch.device, expert_parallel: bool = False) -> TPGroup:
        """Wait for every worker's RankHello (failing fast when one exits: spawned here, or named by
        the node's ``dead``), then join the group as rank 0. Every worker must be starting.
        ``expert_parallel``: the engine config's, as every worker's."""
        rdzv = self.rendezvous
        self.channel.wait_workers(rdzv.init_timeout_s, self._dead_worker)
        self.group = init_tp_group(0, self.size, device, self.store, host=rdzv.host, timeout_s=rdzv.timeout_s,
                                   expert_parallel=expert_parallel)
        return self.group

    def _dead_worker(self) -> str | None:
        for rank, proc in self.procs.items():
            if proc.exitcode is not None:
                return f"rank {rank} (pid {proc.pid}) {exit_words(proc.exitcode)}"
        return self.dead() if self.dead is not None else None

    def send_step(self, inputs: ForwardInputs) -> None:
        self.channel.send(inputs)

    def send_control(self, kind: str, payload: bytes) -> None:
        """An instruction for every worker's ``controls[kind]``, run after the step launched last
        and before the next (e.g. pack this rank's heads of blocks a step just completed)."""
        self.channel.send(Control(kind, payload))

    def explain(self, error: BaseException, wait_s: float = 2.0) -> TPFailure:
        """A ``TPFailure`` naming what happened to the ranks behind ``error`` (a collective or
        the channel failed): the exit of each worker this leader started (given ``wait_s`` to
        finish dying) and every failure a worker reported."""
        for proc in self.procs.values():
            proc.join(timeout=wait_s / max(1, len(self.procs)))
        facts = [f"rank {r} (pid {p.pid}) {exit_words(p.exitcode)}" for r, p in self.procs.items()
                 if p.exitcode is not None]
        facts += [f"rank {f.rank} reported: {f.error}" for f in self.channel.drain()]
        what = "; ".join(facts) or "no worker exit seen"
        return TPFailure(f"tensor-parallel node of {self.size} ranks is broken ({what}): {error}")

    def close(self) -> None:
        """Stop the workers (Stop message), wait for the ones this leader started and kill those
        that do not exit; close the channel, the group and the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.channel.send(Stop())
        except StepChannelClosed:
            pass  # some worker is gone already: the rest see the channel close
        for proc in self.procs.values():
            proc.join(timeout=JOIN_TIMEOUT_S)
            if proc.exitcode is None:
                log.warning("tensor-parallel worker %s did not stop; killing it", proc.name)
                proc.kill()
                proc.join(timeout=JOIN_TIMEOUT_S)
        self.channel.close()
        if self.group is not None:
            self.group.close()


def exit_words(code: int | None) -> str:
    """How a process ended, in words: "was killed by SIGKILL", "exited with code 3"."""
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _spawned_worker(config: EngineConfig, rank: int, rendezvous: TPRendezvous) -> None:
    """A spawned worker's main: logs go to stderr; exits non-zero when ``run_worker`` raises."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rank} %(name)s %(levelname)s %(message)s")
    try:
        run_worker(config, rank, rendezvous)
    except TPFailure as e:  # rank 0 stopped or broke: say it in one line, not a traceback
        log.error("%s", e)
        raise SystemExit(3)
