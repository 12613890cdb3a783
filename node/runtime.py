"""NodeRuntime: the runtime around a node's engine thread, whatever the node's role.

It builds the engine (its KV cache in shared memory when the shm transport needs it) and
hands it to the EngineThread that runs it, and holds what the event loop knows of them:

- the node's identity (node id, epoch, HTTP and KV addresses), its ``info`` and ``load``
  for the registry, and its presence in Redis once it listens (``redis``: the registry
  heartbeat and the prefix-index publisher, node/redis_link.py, which also refuses a pool
  the node cannot exchange KV with);
- its metrics (node/metrics.py), its KV pool's figures (node/kv_pool_info.py) and its part
  of ``GET /debug/state``;
- /dev/shm KV segments of dead owners removed on start (node/shm_segments.py), its
  own on exit;
- with ``tensor_parallel_size`` N > 1, the node's worker ranks (node/ranks.py): this
  process is rank 0 (HTTP, scheduler, transfer bookkeeping), it starts ranks 1..N-1 before
  the engine, hands the role their messages (``set_rank_handler``) and stops them after
  the engine thread. A rank's death is the node's death (``fail``);
- its structured-output grammars (``grammars``, node/grammar_service.py): compiled in
  worker processes under a CPU-time limit, carried to the engine with each request;
- the node's KV compatibility key (``kv_key``: its registration, every rank's handshake;
  node/ranks.py ``node_kv_key``).

A node fails (``fail``) when a worker rank exits or the engine thread stops on a
``TPFailure``: new work gets 503, the role fails what is in flight at once (``on_failure``:
a decode node breaks its streams so the router migrates them, a prefill node answers
errors so its decode nodes prefill themselves), ``failed`` is set and the process exits
non-zero (node/app.py ``serve``); its supervisor restarts it whole.

The aiohttp app around it (routes, guard, drain) is node/app.py; the role's server
(prefill_node/, decode_node/) is built on both and never writes the runtime's
fields: it hands over what the runtime needs through ``start_loop``.

Holds the engine only between building it and handing it to the EngineThread: from
then on the engine thread owns it, and the event loop knows it through what was
fixed at build time (``limits``, ``kv_caches``, ``layout``, ``kv_pool_info``) and the
EngineThread's messages and published ``stats`` (engine/engine_thread.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable

import msgspec
import torch

from ..common.config import Fault, NodeConfig
from ..common.kv_compat import KVCompat
from ..common.kv_events import KVEvent, Tier
from ..common.load import NodeLoad
from ..common.sampling_params import SamplingParams
from ..common.node_registry import NodeInfo, new_epoch
from ..engine.block_export import BlockExporter
from ..engine.engine_core import EngineCore, RequestDelta
from ..engine.engine_thread import EngineThread
from ..engine.limits import RequestLimits
from ..engine.step_fault import arm_step_fault
from ..engine.models.loader import resolve_model_dir
from ..engine.models.families import read_model_config
from ..engine.parallel.group import TPFailure
from ..engine.models.sharding import check_model_tp
from ..engine.ranks.launch import TPLeader
from ..kvtransfer.block_store import allocate_kv_cache, free_shared_kv_cache
from ..kvtransfer.layout import KVLayout, KVShard
from ..kvtransfer.rank_report import RankMessage
from .grammar_service import GrammarService
from .kv_pool_info import KVPoolInfo
from .metrics import NodeMetrics
from .pull_budget import PullBudget
from .ranks import RankProcs, RoleFactory, node_kv_key
from .redis_link import RedisLink
from .shm_segments import remove_dead_segments, segment_name

log = logging.getLogger(__name__)

PEERS_STOP_S = 10.0  # a data-parallel rank waits its peers' drain grace and this much for them to stop with it


class NodeRuntime:
    # Set by start_engine / start_loop, which the app's lifespan runs before any request:
    limits: RequestLimits
    kv_caches: torch.Tensor  # the engine's KV tensor: transfers read/write the blocks they were given
    layout: KVLayout
    kv_pool_info: KVPoolInfo
    engine_thread: EngineThread  # the only way to the engine once started
    grammars: GrammarService | None  # None: a simulated engine (structured outputs refused)

    kv_key: KVCompat  # the node's KV compatibility key (its registration; every rank's handshake)
    shard: KVShard  # rank 0's part of the node's KV: the key and rank 0 (its layout is ``layout``)

    def __init__(self, config: NodeConfig, rank_role: RoleFactory | None = None):
        """``rank_role``: the role's code on each worker rank (node/ranks.py), for a node
        with ``tensor_parallel_size`` > 1."""
        self.config = config
        cfg = config.engine
        self.tp = cfg.tensor_parallel_size if cfg.sim is None else 1  # a simulated node stands for TP in timing
        self._rank_role = rank_role
        self.leader: TPLeader | None = None  # rank 0's end of the step channel: the engine thread's
        self.ranks: RankProcs | None = None  # the worker ranks (TP > 1)
        self._rank_handler: Callable[[int, RankMessage], None] | None = None
        self._rank_backlog: list[tuple[int, RankMessage]] = []  # messages before the role took them
        self.failure: str | None = None  # why the node cannot go on (a rank died); set once
        self.failed = asyncio.Event()  # set with ``failure``: serve() ends the process non-zero
        self.on_failure: list[Callable[[str], None]] = []  # the role's: fail what is in flight
        self.epoch = new_epoch()
        self.node_id = config.node_id  # "" until listening: then <role>-<host>-<port>
        self._engine: EngineCore | None = None  # built, not yet handed to the EngineThread
        self.shm_name: str | None = None
        self.kv_addr = ""  # where the node receives KV blocks (a decode node's receiver), if anywhere
        self.http_addr = ""  # set once listening
        self.metrics = NodeMetrics(config.engine.model_id, config.role)
        # what serving other nodes' prefix pulls may cost this node (node/pull_holder.py PullHolder's)
        self.pull_budget = PullBudget(config.kv_pull_memory, lambda: self.engine_thread.stats)
        self.draining = False  # SIGTERM received: new work is refused with 503
        self._heartbeat_stopped = False
        self.redis: RedisLink | None = None  # None: no --redis-url, the node is not discoverable

    async def start_engine(self, shm: bool) -> None:
        """Load the model off the event loop (seconds); with ``shm`` the KV cache lives in
        /dev/shm so a same-host prefill node can write blocks straight into it."""
        factory = None
        removed = remove_dead_segments()
        if removed:
            log.info("removed %d /dev/shm KV segments of dead processes: %s", len(removed), ", ".join(removed))
        if shm:
            name = self.shm_name = segment_name(os.getpid())
            factory = lambda shape, dtype: allocate_kv_cache(KVLayout.of_cache(shape, dtype), shape[2], name)
        cfg = self.config.engine
        if self.tp > 1:
            self._start_ranks()
        try:
            # the tiers' moves, hits and faults: counted by the metrics, on the engine thread
            engine = self._engine = await asyncio.to_thread(EngineCore, cfg, factory, self.leader, self.metrics)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close(join_s=2.0)  # the engine sent them Stop, if it got that far
            raise
        if self.config.fault == Fault.STEP_ERROR:
            arm_step_fault(engine.runner, engine.scheduler)
        kv = engine.runner.kv_caches
        self.limits, self.kv_caches = engine.limits, kv
        c = self.config
        self.grammars = None if engine.grammars is None else GrammarService(
            engine.grammars.tokenizer_info, c.grammar_compile_workers, c.grammar_compile_timeout_s, self.metrics)
        self.layout = KVLayout.of_cache(kv.shape, kv.dtype)
        if c.kv_pull_memory < self.layout.block_nbytes:
            raise ValueError(f"--kv-pull-memory: {c.kv_pull_memory} bytes cannot hold one KV block of this node "
                             f"({self.layout.block_nbytes} bytes); give at least that, e.g. "
                             f"{max(self.layout.block_nbytes, 64 << 20)}")
        if cfg.sim is None:
            self.kv_key = node_kv_key(cfg, engine.model_config, kv.dtype, self.tp)
        else:  # a simulated node's cache is a token-sized stand-in: its key is that cache's
            self.kv_key = KVShard.of_layout(self.layout, cfg.model_id).compat
        self.shard = KVShard(self.kv_key, 0)
        assert self.shard.layout == self.layout, f"rank 0's cache {self.layout} is not {self.shard.describe()}'s"
        # engine.num_blocks: the tensor may hold one more (static decode's scratch block)
        self.kv_pool_info = KVPoolInfo.of(kv, engine.num_blocks, self.kv_key, self.tp, cfg)
        info = self.kv_pool_info
        self.metrics.set_kv_pool(info.device, info.dtype, info.blocks, info.bytes, info.tokens)

    async def grammar(self, params: SamplingParams, may_compile: bool = True) -> Any:
        """The compiled grammar of a checked request's structured output (None without one),
        for its AddRequest / AddPrefilled. Raises InvalidRequest (a 400), CompileUnavailable
        (a 503 + Retry-After) or, not ``may_compile``, GrammarNotCompiled (a 409)."""
        if params.structured_outputs is None:
            return None
        assert self.grammars is not None, "limits.check refuses structured outputs on a simulated node"
        return await self.grammars.grammar(params.structured_outputs, may_compile)

    def _start_ranks(self) -> None:
        """Check the model splits over the ranks (a clear error before any process starts),
        then bind rank 0's end and start ranks 1..N-1; they join while the engine loads."""
        cfg = self.config.engine
        check_model_tp(read_model_config(resolve_model_dir(cfg.model)), self.tp, cfg.enable_expert_parallel)
        assert self._rank_role is not None, "a tensor-parallel node needs its role's rank code"
        self.leader = TPLeader(self.tp, dead=lambda: self.ranks.dead() if self.ranks is not None else None)
        self.ranks = RankProcs(self.config, self._rank_role, self.leader.rendezvous)
        self.ranks.attach(asyncio.get_running_loop(), self._on_rank_message, self._on_rank_exit)
        log.info("tensor-parallel node of %d ranks: workers %s", self.tp,
                 ", ".join(f"rank {r} pid {pid}" for r, pid in self.ranks.pids.items()))

    def _on_rank_message(self, rank: int, msg: RankMessage) -> None:
        if self._rank_handler is None:
            self._rank_backlog.append((rank, msg))
        else:
            self._rank_handler(rank, msg)

    def set_rank_handler(self, handler: Callable[[int, RankMessage], None]) -> None:
        """The role's handler of its workers' messages (on the event loop); those that came
        before it was set are handed over first."""
        self._rank_handler = handler
        backlog, self._rank_backlog = self._rank_backlog, []
        for rank, msg in backlog:
            handler(rank, msg)

    def _on_rank_exit(self, words: str) -> None:
        # while the engine builds, its join fails with these words too (TPLeader(dead=...))
        self.fail(f"tensor-parallel {words}")

    def _on_engine_fatal(self, error: TPFailure) -> None:
        self.fail(str(error))

    def fail(self, reason: str) -> None:
        """The node cannot go on (a rank died or hangs): refuse new work, let the role fail
        what is in flight now (``on_failure``), and set ``failed`` (the process exits
        non-zero: node/app.py). Idempotent; the event loop only."""
        if self.failure is not None:
            return
        self.failure = reason
        self.draining = True
        log.error("node %s is broken and exits: %s", self.node_id or self.config.role, reason)
        for callback in self.on_failure:
            try:
                callback(reason)
            except Exception:  # the others still run, and the node still exits
                log.exception("failing in-flight work after %s", reason)
        self.failed.set()

    def start_loop(self, on_deltas: Callable[[list[RequestDelta]], None],
                   exporter: BlockExporter | None = None, kv_addr: str = "") -> None:
        """Hand the engine to its EngineThread, which reports to the role's server:
        ``on_deltas`` (its requests' tokens) and ``exporter`` (how it packs prompt blocks,
        a prefill node's). ``kv_addr``: where the node receives KV blocks, registered."""
        def deliver(deltas: list[RequestDelta]) -> None:
            on_deltas(deltas)
            if self.redis is not None and any(d.finish_reason for d in deltas):
                self.redis.heartbeat.nudge()  # load dropped: tell the routers now, not in ~1.7 s
        assert self._engine is not None, "start_engine first"
        self.kv_addr = kv_addr
        self.engine_thread = EngineThread(self._engine, asyncio.get_running_loop(), deliver, self._on_kv_events,
                                          exporter, step_observer=self.metrics.observe_step,
                                          on_fatal=self._on_engine_fatal)
        self._engine = None  # the engine thread's from here on
        self.engine_thread.start()

    def _on_kv_events(self, events: list[KVEvent], snapshot: dict[int, Tier] | None) -> None:
        # Before the publisher starts the events are dropped: its first write is a snapshot.
        if self.redis is not None:
            self.redis.publisher.on_kv(events, snapshot)

    def info(self) -> NodeInfo:
        return NodeInfo(node_id=self.node_id, role=self.config.role, http_addr=self.http_addr,
                        model=self.config.engine.model_id, epoch=self.epoch, kv_backend=self.config.kv_backend,
                        kv_addr=self.kv_addr, capacity_tokens=self.limits.kv_capacity_tokens,
                        block_size=self.config.engine.block_size, max_model_len=self.limits.max_model_len,
                        load=self.load(), kv=self.kv_key, tiers=list(self.engine_thread.stats.tiers))

    def load(self) -> NodeLoad:
        """The engine's published load, with the prefix pulls this node serves."""
        pulls = self.pull_budget.load(self.layout.block_nbytes)
        return msgspec.structs.replace(self.engine_thread.load, pulls_serving=pulls.serving,
                                       pull_bytes_per_s=pulls.bytes_per_s)

    async def listening(self, port: int) -> None:
        """The node serves HTTP on ``port`` (the config's, or the one port 0 picked): its
        address and final node id are known, so register it and publish its prefix-cache
        index."""
        self.http_addr = f"http://{self.config.host}:{port}"
        self.node_id = self.config.node_id or f"{self.config.role}-{self.config.host}-{port}"
        if self.config.redis_url:  # refused here if the pool's nodes cannot exchange KV with it
            self.redis = await RedisLink.join(self.config.redis_url, self.config.role, self.kv_key, self.node_id,
                                              self.epoch, self.info, self.engine_thread.request_kv_snapshot,
                                              self.metrics.index_batches)

    async def start_draining(self) -> None:
        """Refuse new work from now on (node/app.py answers 503) and deregister, so routers
        stop choosing this node; in-flight requests go on."""
        self.draining = True
        await self.stop_heartbeat()

    async def stop_heartbeat(self) -> None:
        """Deregister and stop publishing (idempotent: drain calls it, then the lifespan)."""
        if self._heartbeat_stopped:
            return
        self._heartbeat_stopped = True
        if self.redis is not None:
            await self.redis.close()

    def shutdown(self) -> None:
        """Kill the grammar compile workers, stop the engine thread, then the worker ranks (the
        engine's Stop; killed if they do not exit), then free the shared KV cache."""
        grammars: GrammarService | None = getattr(self, "grammars", None)
        if grammars is not None:
            grammars.close()  # kills the compile workers
        if hasattr(self, "engine_thread"):
            # a data-parallel rank stops with its peers (EngineThread.stop), which drain as long as it may
            peers = self.config.engine.data_parallel_size > 1 and self.failure is None
            stopped = (self.engine_thread.stop(self.config.drain_grace_s + PEERS_STOP_S) if peers
                       else self.engine_thread.stop())
            if stopped and self.ranks is not None and self.failure is None:
                self.engine_thread.close_engine()  # Stop to every worker: they exit 0
        if self.ranks is not None:
            self.ranks.close(join_s=2.0 if self.failure is not None else 10.0)
        if self.shm_name:
            free_shared_kv_cache(self.shm_name)

    def refresh_metrics(self) -> None:
        """Set the engine-state gauges from the latest published load (before a scrape)."""
        self.metrics.set_load(self.load(), self.engine_thread.stats.preemptions,
                              self.redis.heartbeat.failures if self.redis is not None else 0)
        self.metrics.pull_packed_bytes.set(self.pull_budget.packed_bytes)
        self.metrics.set_tiers(self.engine_thread.stats.tiers)
        self.metrics.set_expert_load(self.engine_thread.stats.expert_load)

    def state(self) -> dict:
        """The runtime's part of ``GET /debug/state`` (the role's server adds its own)."""
        st = self.engine_thread.stats
        pub = None if self.redis is None else self.redis.publisher
        index = None if pub is None else {"seq": pub.seq, "in_sync": pub.in_sync, "snapshots": pub.snapshots}
        return {"node_id": self.node_id, "role": self.config.role, "epoch": self.epoch, "pid": os.getpid(),
                "shm_name": self.shm_name, "kv_addr": self.kv_addr, "draining": self.draining, "kv_index": index,
                "device": self.config.engine.device, "dtype": self.config.engine.dtype,
                "tensor_parallel_size": self.tp, "worker_pids": self.ranks.pids if self.ranks is not None else {},
                "expert_parallel": self.config.engine.enable_expert_parallel and self.tp > 1,
                "data_parallel": {"rank": self.config.engine.data_parallel_rank,
                                  "size": self.config.engine.data_parallel_size},
                "failure": self.failure, "kv": msgspec.structs.asdict(self.kv_key),
                "kv_pool": self.kv_pool_info._asdict(),
                "kv_blocks_total": st.kv_blocks_total, "kv_blocks_free": st.kv_blocks_free,
                "load": msgspec.structs.asdict(st.load), "steps": st.steps, "busy_s": st.busy_s,
                "computed_tokens": st.computed_tokens, "preemptions": st.preemptions,
                "sim_overrun_s": st.sim_overrun_s, "pull_budget": self.pull_budget.state()}
