"""Node discovery: the router's current list of live nodes, re-read from the Redis
node registry in a background task.

Owns the last known node list of the served model (nodes of another model, or whose
KV block size differs from the router's, are ignored with a warning: their prefix
hashes would never match), the context length they accept, and the decision to keep it when
Redis is unreachable (routing degrades to the last known nodes; it never fails a
request because Redis is down). Also remembers nodes this router just failed to
reach, so retries and the next requests avoid them until they heart-beat again
under a new epoch or a short quarantine passes.

Must not route (policy.py does) or create its Redis client (the app's lifespan
owns the `NodeRegistry`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from ...common.node_registry import REDIS_ERRORS, NodeInfo, NodeRegistry
from ..metrics import RouterMetrics

log = logging.getLogger(__name__)

UNREACHABLE_QUARANTINE_S = 5.0  # about one node registry TTL: a dead node's record expires by then


@dataclass(slots=True)
class NodeDirectory:
    registry: NodeRegistry
    model_id: str
    metrics: RouterMetrics
    poll_interval_s: float = 0.5
    block_size: int = 0  # the router's block size; nodes reporting another are ignored (0: no check)
    nodes: list[NodeInfo] = field(default_factory=list)  # last known nodes of model_id
    redis_ok: bool | None = None  # the last poll reached Redis (None: not polled yet)
    polls: int = 0  # successful polls
    _unreachable: dict[str, tuple[str, float]] = field(default_factory=dict)  # node_id -> (epoch, until)
    other_models: dict[str, str] = field(default_factory=dict)  # node_id -> the other model it serves
    other_block_sizes: dict[str, int] = field(default_factory=dict)  # node_id -> its other block size
    _task: asyncio.Task | None = None
    _recovered_until: float = 0.0  # until then, keep last known nodes missing from the node registry

    async def refresh(self) -> bool:
        """Re-read the node registry now; on a Redis error keep the last list. True if read."""
        try:
            found = await self.registry.list_nodes()
        except REDIS_ERRORS as e:
            self.metrics.redis_errors.labels(op="list_nodes").inc()
            if self.redis_ok is not False:  # log once per outage
                log.warning("router: Redis unreachable (%s); routing with the %d last known "
                            "nodes until it is back", e, len(self.nodes))
            self.redis_ok = False
            return False
        now = time.monotonic()
        if self.redis_ok is False:
            log.info("router: Redis reachable again; %d nodes registered", len(found))
            # A Redis that restarted empty lists nodes only as their heartbeats come back:
            # keep routing to the last known ones for about one node registry TTL meanwhile.
            self._recovered_until = now + UNREACHABLE_QUARANTINE_S
        self.redis_ok = True
        self.polls += 1
        self._unreachable = {k: v for k, v in self._unreachable.items() if v[1] > now}
        fresh = [n for n in found if self._serves_model(n)]
        if now < self._recovered_until:
            seen = {n.node_id for n in fresh}
            fresh += [n for n in self.nodes if n.node_id not in seen]
        self.nodes = fresh
        for role in ("prefill", "decode", "colocated"):
            self.metrics.nodes.labels(role=role).set(sum(n.role == role for n in self.nodes))
        return True

    def _serves_model(self, node: NodeInfo) -> bool:
        if node.model == self.model_id:
            return self._same_block_size(node)
        if self.other_models.get(node.node_id) != node.model:  # warn once per node and model
            self.other_models[node.node_id] = node.model
            log.warning("router: ignoring node %s: it serves model %r, this router serves %r",
                        node.node_id, node.model, self.model_id)
        return False

    def _same_block_size(self, node: NodeInfo) -> bool:
        if not self.block_size or not node.block_size or node.block_size == self.block_size:
            return True
        if self.other_block_sizes.get(node.node_id) != node.block_size:  # warn once per node and size
            self.other_block_sizes[node.node_id] = node.block_size
            log.warning("router: ignoring node %s (%s): its KV block size is %d, this router hashes "
                        "prompts in blocks of %d (--block-size); restart one side with the other's",
                        node.node_id, node.http_addr, node.block_size, self.block_size)
        return False

    def max_model_len(self, default: int) -> int:
        """The context every live node accepts: the smallest one they report, at most
        ``default`` (the router's tokenizer's)."""
        return min([default, *(n.max_model_len for n in self.nodes if n.max_model_len > 0)])

    def model_mismatch(self) -> str | None:
        """Why this router must not start: every node registered serves another model
        (None when some node serves ours, or none is registered yet)."""
        if self.nodes or not self.other_models:
            return None
        models = ", ".join(sorted({f"`{m}`" for m in self.other_models.values()}))
        return (f"served_model_name: the registered nodes serve {models}, this router serves "
                f"`{self.model_id}`; give the router the nodes' --model and --served-model-name")

    def live(self) -> list[NodeInfo]:
        """The nodes to route to: the last known list minus nodes recently unreachable."""
        if not self._unreachable:
            return self.nodes
        now = time.monotonic()
        out = []
        for n in self.nodes:
            bad = self._unreachable.get(n.node_id)
            if bad is not None and bad[0] == n.epoch and now < bad[1]:
                continue
            out.append(n)
        return out

    def mark_unreachable(self, node: NodeInfo) -> None:
        """Avoid ``node`` until it restarts (new epoch) or the quarantine passes."""
        if node.node_id not in self._unreachable:
            log.warning("router: node %s (%s) is down; not routing to it until it re-registers "
                        "with a new epoch", node.node_id, node.http_addr)
        self._unreachable[node.node_id] = (node.epoch, time.monotonic() + UNREACHABLE_QUARANTINE_S)

    def mark_addr_down(self, http_addr: str) -> None:
        """``mark_unreachable`` for the known node serving ``http_addr`` (a connection to it
        failed or broke): routing stops at once instead of after its record expires."""
        for n in self.nodes:
            if n.http_addr == http_addr:
                self.mark_unreachable(n)

    def counts(self) -> dict[str, int]:
        """role -> number of live nodes."""
        live = self.live()
        return {role: sum(n.role == role for n in live) for role in ("prefill", "decode", "colocated")}

    # -- background polling (started and stopped by the app's lifespan) ---------

    def start(self) -> None:
        assert self._task is None, "NodeDirectory.start called twice"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="node-discovery")

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a bug here must not stop discovery for good
                log.exception("router: node discovery poll failed")
            await asyncio.sleep(self.poll_interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
