"""The load-only routing policies: least_load and round_robin. They ignore the prefix
cache (``uses_prefix_index`` False) and keep no recent work. Both pick the decode node
first, then a prefill node among those that can send it KV (router/routing/kv_pairing.py).

Owns their choice rules. Must not do I/O or keep per-request state (policy.py has
the interface).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

from ...common.node_registry import NodeInfo
from .kv_pairing import compatible_prefills
from .node_terms import split_roles
from .policy import NO_CACHED, NO_INFLIGHT, NO_TIERS, Decision
from .recent_work import RecentWork
from .tier_cost import TierBlocks


def decode_load(node: NodeInfo, inflight: Mapping[str, int]) -> tuple:
    """Sort key, smaller is less loaded: requests on the node, then KV usage."""
    reported = node.load.running + node.load.waiting
    return (max(reported, inflight.get(node.node_id, 0)), node.load.kv_usage)


def prefill_load(node: NodeInfo, inflight: Mapping[str, int]) -> tuple:
    """Sort key: requests still prefilling there, then prompt tokens still queued."""
    reported = node.load.running + node.load.waiting
    return (max(reported, inflight.get(node.node_id, 0)), node.load.queued_prefill_tokens)


class _LoadOnly:
    """What both share: no prefix index, no recent work, the roles split, no decode
    node -> None, the prompt's whole length as the prefill work."""

    name: str
    uses_prefix_index = False
    recent: RecentWork | None = None

    def choose(self, request_token_ids: Sequence[int], nodes: Sequence[NodeInfo],
               inflight: Mapping[str, int] = NO_INFLIGHT, *,
               cached: Mapping[str, int] = NO_CACHED,
               inflight_tokens: Mapping[str, int] = NO_INFLIGHT,
               tie_key: int | None = None,
               tiers: Mapping[str, TierBlocks] = NO_TIERS,
               pulls: Mapping[str, int] = NO_INFLIGHT, **more: object) -> Decision | None:
        """`RoutingPolicy.choose`."""
        prefills, decodes = split_roles(nodes)
        if not decodes:
            return None
        prefill, decode = self._pick(prefills, decodes, inflight, tie_key)
        return Decision(prefill, decode, len(request_token_ids))

    def _pick(self, prefills: list[NodeInfo], decodes: list[NodeInfo], inflight: Mapping[str, int],
              tie_key: int | None) -> tuple[NodeInfo | None, NodeInfo]:
        raise NotImplementedError


class LeastLoad(_LoadOnly):
    """The least loaded decode node and the least loaded prefill node. Ties rotate,
    so equally idle nodes share a burst."""

    name = "least_load"

    def __init__(self) -> None:
        self._tie = itertools.count()

    def _pick(self, prefills: list[NodeInfo], decodes: list[NodeInfo], inflight: Mapping[str, int],
              tie_key: int | None) -> tuple[NodeInfo | None, NodeInfo]:
        turn = next(self._tie) if tie_key is None else tie_key
        decode = _least(decodes, decode_load, inflight, turn)
        assert decode is not None  # decodes is not empty
        return _least(compatible_prefills(prefills, decode), prefill_load, inflight, turn), decode


class RoundRobin(_LoadOnly):
    """Decode and prefill nodes in turn, ignoring load."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def _pick(self, prefills: list[NodeInfo], decodes: list[NodeInfo], inflight: Mapping[str, int],
              tie_key: int | None) -> tuple[NodeInfo | None, NodeInfo]:
        turn = next(self._turn)  # ignores tie_key: it rotates by design
        decode = decodes[turn % len(decodes)]
        prefills = compatible_prefills(prefills, decode)
        return prefills[turn % len(prefills)] if prefills else None, decode


def _least(nodes: list[NodeInfo], key: Callable[[NodeInfo, Mapping[str, int]], tuple],
           inflight: Mapping[str, int], turn: int) -> NodeInfo | None:
    if not nodes:
        return None
    keys = [key(n, inflight) for n in nodes]
    best = min(keys)
    tied = [n for n, k in zip(nodes, keys) if k == best]
    return tied[turn % len(tied)]
