"""The router's view of the prefix index: a prompt -> predicted cached prompt tokens
per node, or nothing when Redis is unreachable.

Owns the router's half of "one hash, everywhere" (the prompt's chained block hashes,
computed with ``common.hashing``, the served model id as the extra key and
RouterConfig.block_size, as every node does), the lookup timeout, the back-off
after a failed lookup, and the metrics and log lines of an outage. Must not create
its Redis client (the app's lifespan owns the `KVIndex`) or raise: a lookup that
fails is an empty result, and routing goes on by load only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from splitserve.common.hashing import hash_blocks
from splitserve.common.kv_index import REDIS_ERRORS, KVIndex
from splitserve.common.registry import NodeInfo
from splitserve.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


class PrefixHits(NamedTuple):
    cached: dict[str, int]  # node_id -> predicted cached prompt tokens (nodes with a hit only)
    num_blocks: int  # full blocks of the prompt
    looked_up: bool  # False: the index was not read (Redis down): no prediction


@dataclass(slots=True)
class PrefixIndex:
    index: KVIndex
    metrics: RouterMetrics
    model_id: str  # the extra key of every block hash
    block_size: int
    timeout_s: float = 0.25
    retry_s: float = 1.0  # after a failed lookup, skip the index this long
    _retry_at: float = 0.0  # monotonic time before which lookups are skipped
    _down: bool = False  # in an outage (logged once)
    _mismatched: set[str] = field(default_factory=set)  # node ids warned about

    async def lookup(self, prompt: Sequence[int], nodes: Sequence[NodeInfo]) -> PrefixHits:
        """Predicted cached prompt tokens per node: the longest run of the prompt's
        leading blocks each node holds (at the epoch of its registry record), in
        tokens, capped like the engine caps a hit (at least one token is computed).
        Never raises; one Redis round trip at most."""
        bs = self.block_size
        hashes = hash_blocks(prompt, bs, (self.model_id,))
        usable = [n for n in nodes if self._same_block_size(n)]
        max_blocks = min(len(hashes), (len(prompt) - 1) // bs)
        if max_blocks == 0 or not usable:
            return PrefixHits({}, len(hashes), True)  # nothing any node could serve
        if time.monotonic() < self._retry_at:
            self.metrics.index_lookups.labels(result="skipped").inc()
            return PrefixHits({}, len(hashes), False)
        try:
            async with asyncio.timeout(self.timeout_s):
                runs = await self.index.longest_runs(hashes[:max_blocks], usable)
        except REDIS_ERRORS as e:  # asyncio.timeout raises TimeoutError, one of them
            self._failed(e)
            return PrefixHits({}, len(hashes), False)
        if self._down:
            self._down = False
            log.info("router: prefix index reachable again; routing by cache and load")
        self._retry_at = 0.0
        self.metrics.index_lookups.labels(result="ok").inc()
        return PrefixHits({nid: run * bs for nid, run in runs.items() if run}, len(hashes), True)

    def _failed(self, e: BaseException) -> None:
        self.metrics.index_lookups.labels(result="error").inc()
        self.metrics.redis_errors.labels(op="index_lookup").inc()
        self._retry_at = time.monotonic() + self.retry_s
        if not self._down:
            self._down = True
            log.warning("router: prefix index lookup failed (%r); routing by load only, "
                        "retrying every %.1fs", e, self.retry_s)

    def _same_block_size(self, node: NodeInfo) -> bool:
        if node.block_size in (0, self.block_size):  # 0: a node that does not say
            return True
        if node.node_id not in self._mismatched:
            self._mismatched.add(node.node_id)
            log.warning("router: node %s uses block size %d, this router %d (--block-size): "
                        "its prefix cache is invisible to routing", node.node_id,
                        node.block_size, self.block_size)
        return False
