"""The node registry: which prefill / decode nodes are alive, where, and how loaded.

Owns the Redis layout of node records and the heartbeat that keeps them alive. Each
node writes its `NodeInfo` (msgpack) under ``splitserve:node:{node_id}`` with a TTL;
a node that stops heart-beating (crash, partition) disappears after the TTL, so
readers never see a dead node for longer than ``ttl_s``::

    node --heartbeat every ttl/3--> SET splitserve:node:{id} <msgpack NodeInfo> PX ttl
    router --every ~0.5 s---------> SCAN splitserve:node:* + MGET  -> list[NodeInfo]

Must not: import torch or any node code, or let a Redis outage crash a node
(`Heartbeat` logs and retries; `NodeRegistry` methods raise and leave the policy to
their caller).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError

from .config import NodeRole
from .kv_compat import KVCompat
from .kv_tier_stats import TierStats
from .load import NodeLoad

log = logging.getLogger(__name__)

KEY_PREFIX = "splitserve:node:"
# What a Redis call can raise when the server is down, slow or unreachable.
REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)



class NodeInfo(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """One node's node registry record. ``epoch`` changes on every start of the node, so
    state tagged with an old epoch (prefix-index entries) can be told apart."""

    node_id: str
    role: NodeRole
    http_addr: str  # "http://host:port"
    model: str  # served model id; the router only routes to nodes of its model
    epoch: str
    kv_backend: str = ""
    kv_addr: str = ""
    capacity_tokens: int = 0  # tokens the node's KV cache holds
    block_size: int = 0  # tokens per KV block, as hashed into the prefix index (0: unknown)
    max_model_len: int = 0  # the context the node accepts, prompt + output tokens (0: unknown)
    # What a peer must share to exchange KV with it (model, dtype, block size, head layout,
    # TP); routers pair only compatible nodes (router/routing/kv_pairing.py). None: not published.
    kv: KVCompat | None = None
    # Each tier of its prefix cache, device first (a node without lower tiers: the device
    # tier alone, or nothing from an older node); common/kv_tier_stats.py.
    tiers: list[TierStats] = []
    load: NodeLoad = msgspec.field(default_factory=NodeLoad)
    updated_at: float = 0.0  # unix time of the heartbeat that wrote this record

    @property
    def decode_capable(self) -> bool:
        return self.role in ("decode", "colocated")


def kv_pool_problem(role: NodeRole, kv: KVCompat, nodes: list[NodeInfo]) -> str | None:
    """Why a starting node of ``role`` with KV key ``kv`` can exchange KV with none of the
    registered nodes of the other role that publish a key (None: with some, or none
    registered yet). A node calls it at start-up to refuse a pool it cannot join, naming
    the mismatch, rather than be paired with nobody."""
    if role == "colocated":
        return None
    peers = [(n.node_id, n.kv) for n in nodes if n.kv is not None and (n.role == "prefill") == (role != "prefill")]
    problems = [f"{nid}: {why}" for nid, theirs in peers if (why := kv.exchange_problem(theirs)) is not None]
    if not peers or len(problems) < len(peers):
        return None
    other = "decode" if role == "prefill" else "prefill"
    return (f"this {role} node's KV cannot be exchanged with any registered {other} node "
            f"(this node != that node): " + "; ".join(problems[:4]) + ("; ..." if len(problems) > 4 else ""))


def new_epoch() -> str:
    """A fresh epoch for a node that is starting."""
    return uuid.uuid4().hex


def node_key(node_id: str) -> str:
    return KEY_PREFIX + node_id


def make_redis(redis_url: str, timeout_s: float = 1.0) -> aioredis.Redis:
    """A Redis client that fails fast when the server is down: short socket timeouts
    and two quick retries, instead of redis-py's default ten with backoff."""
    return aioredis.Redis.from_url(
        redis_url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), retries=2),
    )


class NodeRegistry:
    """Reads and writes node records. Owns one Redis client; call `close()` when done.

    Every method raises one of `REDIS_ERRORS` when Redis is unreachable.
    """

    def __init__(self, redis_url: str, ttl_s: float = 5.0):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._redis = make_redis(redis_url)

    async def heartbeat(self, info: NodeInfo) -> None:
        """Write `info` with a fresh TTL, in one pipelined round trip."""
        ttl_ms = max(1, int(self.ttl_s * 1000))
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(node_key(info.node_id), msgspec.msgpack.encode(info), px=ttl_ms)
            await pipe.execute()

    async def deregister(self, node_id: str) -> None:
        """Remove the node's record now (a clean shutdown); idempotent."""
        await self._redis.delete(node_key(node_id))

    async def list_nodes(self) -> list[NodeInfo]:
        """Every live node, sorted by node_id. Records that fail to decode (another
        version of splitserve) are skipped and logged."""
        keys = [key async for key in self._redis.scan_iter(match=KEY_PREFIX + "*", count=500)]
        if not keys:
            return []
        nodes = []
        for key, raw in zip(keys, await self._redis.mget(keys)):
            if raw is None:  # expired between SCAN and MGET
                continue
            assert isinstance(raw, bytes)  # make_redis's client does not decode responses
            try:
                nodes.append(msgspec.msgpack.decode(raw, type=NodeInfo))
            except msgspec.DecodeError as e:
                log.warning("node registry: skipping undecodable record %r: %s", key, e)
        nodes.sort(key=lambda n: n.node_id)
        return nodes

    async def close(self) -> None:
        await self._redis.aclose()


MIN_BEAT_GAP_S = 0.1  # nudged beats: at most ten a second per node


@dataclass(slots=True)
class Heartbeat:
    """Keeps one node's record alive: writes ``info_fn()`` every ``ttl_s / 3`` seconds.

    ``info_fn`` is called on every beat so the record carries the current load;
    `updated_at` is stamped here. Redis errors are logged (once per outage, then on
    recovery) and never raised: a Redis outage must not crash a node. Use::

        hb = Heartbeat(registry, lambda: NodeInfo(...))
        hb.start()                       # inside a running event loop
        ...
        await hb.stop()                  # deregisters by default
    """

    registry: NodeRegistry
    info_fn: Callable[[], NodeInfo]
    failures: int = 0  # consecutive failed beats
    beats: int = 0  # successful beats since start
    _task: asyncio.Task | None = field(default=None, repr=False)
    _nudged: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _node_id: str | None = None  # the last node id written, for deregister on stop

    @property
    def interval_s(self) -> float:
        return self.registry.ttl_s / 3

    def start(self) -> None:
        assert self._task is None, "Heartbeat.start called twice"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="heartbeat")

    async def beat(self) -> bool:
        """One heartbeat now; True if it reached Redis."""
        info = self.info_fn()
        info.updated_at = time.time()
        self._node_id = info.node_id
        try:
            await self.registry.heartbeat(info)
        except REDIS_ERRORS as e:
            if self.failures == 0:
                log.warning("heartbeat of node %s failed (Redis unreachable?), retrying every "
                            "%.2fs: %r", info.node_id, self.interval_s, e)
            self.failures += 1
            return False
        if self.failures:
            log.info("heartbeat of node %s recovered after %d failed beats",
                     info.node_id, self.failures)
        self.failures = 0
        self.beats += 1
        return True

    def nudge(self) -> None:
        """Beat soon (at most every ``MIN_BEAT_GAP_S``) instead of at the next interval:
        a node calls this when its load drops, so routers do not avoid an idle node
        on the strength of a stale record."""
        self._nudged.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            self._nudged.clear()
            await self.beat()
            await asyncio.sleep(MIN_BEAT_GAP_S)
            try:
                await asyncio.wait_for(self._nudged.wait(),
                                       max(0.0, self.interval_s - (loop.time() - started)))
            except TimeoutError:
                pass

    async def stop(self, deregister: bool = True) -> None:
        """Stop beating; with `deregister`, delete the record so routers forget the
        node at once instead of after the TTL (errors logged, not raised)."""
        if self._task is not None:
            # Again until it ends: Python 3.11's wait_for swallows a cancel that lands as the
            # nudge it waits for is set (a finished request nudges), and the loop would go on.
            while not self._task.done():
                self._task.cancel()
                # wait, not gather: our own cancellation still propagates, the task's does not
                await asyncio.wait({self._task}, timeout=0.5)
            self._task = None
        if deregister and self._node_id is not None:
            try:
                await self.registry.deregister(self._node_id)
            except REDIS_ERRORS as e:
                log.warning("deregister of node %s failed: %r", self._node_id, e)
