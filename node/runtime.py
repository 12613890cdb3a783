"""NodeRuntime: the parts every node process shares, whatever its role.

- the engine (its KV cache in shared memory when the shm transport needs it)
  and the EngineThread that runs it;
- the node's identity (node id, epoch, HTTP and KV addresses) and its registry
  heartbeat with load;
- the publisher of its prefix-cache events to the Redis index (node/kv_publisher.py),
  fed from the engine thread, under the same node id and epoch;
- its metrics (node/metrics.py) and its part of ``GET /debug/state`` (device, dtype,
  KV pool, load);
- /dev/shm KV segments of dead owners removed on start (node/shm_segments.py), its
  own on exit.

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
from typing import Callable, NamedTuple

import msgspec
import torch

from ..common.config import NodeConfig
from ..common.kv_events import KVEvent
from ..common.kv_index import KVIndex
from ..common.registry import Heartbeat, NodeInfo, NodeRegistry, new_epoch
from ..engine.engine_core import EngineCore, RequestDelta
from ..engine.engine_thread import BlockExporter, EngineThread
from ..engine.limits import RequestLimits
from ..kvtransfer.block_store import allocate_kv_cache, free_shared_kv_cache
from ..kvtransfer.layout import KVLayout
from .kv_publisher import KVEventPublisher
from .metrics import NodeMetrics
from .shm_segments import remove_dead_segments, segment_name

log = logging.getLogger(__name__)


class KVPoolInfo(NamedTuple):
    """Where the node's KV block pool lives and how big it is (/debug/state, metrics)."""
    device: str  # torch device, e.g. "cpu", "cuda:0"
    dtype: str  # "float32", "bfloat16", ...
    blocks: int  # usable blocks (the tensor may hold one more: static decode's scratch block)
    bytes: int
    tokens: int
    gpu_memory_utilization: float | None  # the fraction it was sized from, if any


class RedisLink(NamedTuple):
    """The node's presence in Redis: its registry record and its prefix-index stream."""
    registry: NodeRegistry
    heartbeat: Heartbeat
    kv_index: KVIndex
    publisher: KVEventPublisher


class NodeRuntime:
    # Set by start_engine / start_loop, which the app's lifespan runs before any request:
    limits: RequestLimits
    kv_caches: torch.Tensor  # the engine's KV tensor: transfers read/write the blocks they were given
    layout: KVLayout
    kv_pool_info: KVPoolInfo
    engine_thread: EngineThread  # the only way to the engine once started

    def __init__(self, config: NodeConfig):
        self.config = config
        self.epoch = new_epoch()
        self.node_id = config.node_id  # "" until listening: then <role>-<host>-<port>
        self._engine: EngineCore | None = None  # built, not yet handed to the EngineThread
        self.shm_name: str | None = None
        self.kv_addr = ""  # where the node receives KV blocks (a decode node's receiver), if anywhere
        self.http_addr = ""  # set once listening
        self.metrics = NodeMetrics(config.engine.model_id, config.role)
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
        engine = self._engine = await asyncio.to_thread(EngineCore, self.config.engine, factory)
        kv, cfg = engine.runner.kv_caches, self.config.engine
        self.limits, self.kv_caches = engine.limits, kv
        self.layout = KVLayout.of_cache(kv.shape, kv.dtype)
        blocks = engine.num_blocks  # the tensor may hold one more: static decode's scratch block
        block_bytes = kv.numel() * kv.element_size() // kv.shape[2]
        self.kv_pool_info = KVPoolInfo(device=str(kv.device), dtype=str(kv.dtype).removeprefix("torch."),
                                       blocks=blocks, bytes=blocks * block_bytes, tokens=blocks * cfg.block_size,
                                       gpu_memory_utilization=cfg.gpu_memory_utilization)
        info = self.kv_pool_info
        self.metrics.set_kv_pool(info.device, info.dtype, info.blocks, info.bytes, info.tokens)

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
                                          exporter, step_observer=self.metrics.observe_step)
        self._engine = None  # the engine thread's from here on
        self.engine_thread.start()

    def _on_kv_events(self, events: list[KVEvent], snapshot: list[int] | None) -> None:
        # Before the publisher starts the events are dropped: its first write is a snapshot.
        if self.redis is not None:
            self.redis.publisher.on_kv(events, snapshot)

    def info(self) -> NodeInfo:
        return NodeInfo(node_id=self.node_id, role=self.config.role, http_addr=self.http_addr,
                        model=self.config.engine.model_id, epoch=self.epoch, kv_backend=self.config.kv_backend,
                        kv_addr=self.kv_addr, capacity_tokens=self.limits.kv_capacity_tokens,
                        block_size=self.config.engine.block_size, max_model_len=self.limits.max_model_len,
                        load=self.engine_thread.load)

    async def listening(self, port: int) -> None:
        """The node serves HTTP on ``port`` (the config's, or the one port 0 picked): its
        address and final node id are known, so register it and publish its prefix-cache
        index."""
        self.http_addr = f"http://{self.config.host}:{port}"
        self.node_id = self.config.node_id or f"{self.config.role}-{self.config.host}-{port}"
        if self.config.redis_url:
            index = KVIndex(self.config.redis_url)
            publisher = KVEventPublisher(index, self.node_id, self.epoch, self.engine_thread.request_kv_snapshot,
                                         self.metrics.index_batches)
            registry = NodeRegistry(self.config.redis_url)
            self.redis = RedisLink(registry, Heartbeat(registry, self.info), index, publisher)
            publisher.start()
            self.redis.heartbeat.start()

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
            await self.redis.heartbeat.stop()
            await self.redis.registry.close()
            await self.redis.publisher.stop()
            await self.redis.kv_index.close()

    def shutdown(self) -> None:
        if hasattr(self, "engine_thread"):
            self.engine_thread.stop()
        if self.shm_name:
            free_shared_kv_cache(self.shm_name)

    def refresh_metrics(self) -> None:
        """Set the engine-state gauges from the latest published load (before a scrape)."""
        self.metrics.set_load(self.engine_thread.load, self.engine_thread.stats.preemptions,
                              self.redis.heartbeat.failures if self.redis is not None else 0)

    def state(self) -> dict:
        """The runtime's part of ``GET /debug/state`` (the role's server adds its own)."""
        st = self.engine_thread.stats
        pub = None if self.redis is None else self.redis.publisher
        index = None if pub is None else {"seq": pub.seq, "in_sync": pub.in_sync, "snapshots": pub.snapshots}
        return {"node_id": self.node_id, "role": self.config.role, "epoch": self.epoch, "pid": os.getpid(),
                "shm_name": self.shm_name, "kv_addr": self.kv_addr, "draining": self.draining, "kv_index": index,
                "device": self.config.engine.device, "dtype": self.config.engine.dtype,
                "kv_pool": self.kv_pool_info._asdict(),
                "kv_blocks_total": st.kv_blocks_total, "kv_blocks_free": st.kv_blocks_free,
                "load": msgspec.structs.asdict(st.load), "steps": st.steps, "busy_s": st.busy_s,
                "computed_tokens": st.computed_tokens, "preemptions": st.preemptions,
                "sim_overrun_s": st.sim_overrun_s}
