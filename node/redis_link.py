"""A node's presence in Redis: its registry record kept alive by a heartbeat carrying its
load, and its prefix-cache events published to the index, both under the node's id and
epoch (node/runtime.py builds it once the node listens, and closes it on drain).

Owns ``RedisLink`` (the registry, the heartbeat, the index client, the publisher) and the
start-up refusal of a pool the node cannot exchange KV with (``check_pool``,
common/node_registry.py ``kv_pool_problem``). Must not: know the engine or the node's role
beyond the role's name; a Redis outage is logged, never raised, once the node has joined.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

from prometheus_client import Counter

from ..common.config import NodeRole
from ..common.kv_compat import KVCompat
from ..common.kv_index import KVIndex
from ..common.model_metrics import BoundLabels
from ..common.node_registry import REDIS_ERRORS, Heartbeat, NodeInfo, NodeRegistry, kv_pool_problem
from .kv_publisher import KVEventPublisher

log = logging.getLogger(__name__)


class RedisLink(NamedTuple):
    """The node's presence in Redis: its registry record and its prefix-index stream."""
    registry: NodeRegistry
    heartbeat: Heartbeat
    kv_index: KVIndex
    publisher: KVEventPublisher

    @classmethod
    async def join(cls, redis_url: str, role: NodeRole, kv_key: KVCompat, node_id: str, epoch: str,
                   info: Callable[[], NodeInfo], request_snapshot: Callable[[], None],
                   index_batches: BoundLabels[Counter]) -> RedisLink:
        """Check the pool (``check_pool``), then register the node (its heartbeat sends
        ``info()``) and start publishing its prefix-cache events (``request_snapshot``: the
        engine thread's, for the publisher's first write and each resync)."""
        registry = NodeRegistry(redis_url)
        try:
            await check_pool(registry, role, kv_key)
        except BaseException:
            await registry.close()
            raise
        index = KVIndex(redis_url)
        publisher = KVEventPublisher(index, node_id, epoch, request_snapshot, index_batches)
        link = cls(registry, Heartbeat(registry, info), index, publisher)
        publisher.start()
        link.heartbeat.start()
        return link

    async def close(self) -> None:
        """Deregister and stop publishing."""
        await self.heartbeat.stop()
        await self.registry.close()
        await self.publisher.stop()
        await self.kv_index.close()


async def check_pool(registry: NodeRegistry, role: NodeRole, kv_key: KVCompat) -> None:
    """Refuse to join a pool this node cannot exchange KV with (another model, dtype,
    block size or head layout than every registered node of the other role): a
    ``ValueError`` naming each mismatch, before it registers. Redis down: not checked."""
    try:
        nodes = await registry.list_nodes()
    except REDIS_ERRORS as e:
        log.warning("cannot read the registry to check KV compatibility (%r); registering anyway", e)
        return
    problem = kv_pool_problem(role, kv_key, nodes)
    if problem is not None:
        raise ValueError(f"{problem}. Start this node with the pool's model, --dtype and --block-size "
                         f"(any --tensor-parallel-size that splits the model's KV heads pairs), or "
                         f"point it at another --redis-url")
