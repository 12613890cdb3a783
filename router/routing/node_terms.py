"""A node list split by role, and the heartbeat terms of cache_aware's cost
(router/routing/cache_aware.py) for it, as arrays, so that one decision over hundreds of
nodes costs a few vector operations instead of a Python loop per node.

    split_roles the prefill nodes and the decode-capable ones (every policy's first step)
    RoleTerms   one role's nodes (prefill, or decode-capable): their ids, where each id
                sits, and each node's heartbeat load (requests, KV usage, queued prompt
                tokens) as float64 arrays of shape [nodes]
    FleetTerms  both roles of a node list, kept by the policy and reused for as long as
                the routed list equals the one it was built from (same records, same
                loads: a new heartbeat poll or a node left out makes a new one), with
                which pairs can exchange KV (router/routing/kv_pairing.py; None: all)

Owns the split and the terms (building and checking them). Must not weigh anything
(the weights are the policy's) or hold per-request values (in-flight work, hits,
recent work).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from ...common.load import NodeLoad
from ...common.node_registry import NodeInfo
from .kv_pairing import pair_mask


def split_roles(nodes: Sequence[NodeInfo]) -> tuple[list[NodeInfo], list[NodeInfo]]:
    """(prefill nodes, decode-capable nodes: decode and colocated)."""
    return ([n for n in nodes if n.role == "prefill"], [n for n in nodes if n.decode_capable])


@dataclass(slots=True, frozen=True)
class RoleTerms:
    nodes: list[NodeInfo]
    ids: list[str]
    index: dict[str, int]  # node_id -> position in nodes
    requests: np.ndarray  # [nodes] running + waiting at the last heartbeat
    kv_usage: np.ndarray  # [nodes] 0..1
    queued: np.ndarray  # [nodes] queued prefill tokens

    @classmethod
    def of(cls, nodes: list[NodeInfo]) -> RoleTerms:
        loads = [n.load for n in nodes]
        ids = [n.node_id for n in nodes]
        return cls(nodes, ids, {nid: i for i, nid in enumerate(ids)},
                   np.fromiter((ld.running + ld.waiting for ld in loads), np.float64, len(loads)),
                   np.fromiter((ld.kv_usage for ld in loads), np.float64, len(loads)),
                   np.fromiter((ld.queued_prefill_tokens for ld in loads), np.float64, len(loads)))

    def per_node(self, values: Mapping[str, float]) -> np.ndarray:
        """[nodes] ``values[node_id]`` for each node (0 where absent)."""
        if not values:
            return np.zeros(len(self.ids))
        return np.fromiter(map(values.get, self.ids, repeat(0.0)), np.float64, len(self.ids))


@dataclass(slots=True, frozen=True)
class FleetTerms:
    nodes: list[NodeInfo]
    loads: list[NodeLoad]
    prefill: RoleTerms
    decode: RoleTerms  # decode-capable: decode and colocated nodes
    pairs: np.ndarray | None = None  # [prefill nodes, decode nodes] can exchange KV; None: every pair

    @classmethod
    def of(cls, nodes: Sequence[NodeInfo]) -> FleetTerms:
        prefills, decodes = split_roles(nodes)
        return cls(list(nodes), [n.load for n in nodes], RoleTerms.of(prefills), RoleTerms.of(decodes),
                   pair_mask(prefills, decodes))

    def describes(self, nodes: Sequence[NodeInfo]) -> bool:
        """Built from these very nodes with these loads (list equality checks identity
        first: a C loop for the same records, a field compare otherwise)."""
        return (len(nodes) == len(self.nodes) and self.nodes == list(nodes)
                and self.loads == [n.load for n in nodes])

    def node(self, node_id: str) -> NodeInfo | None:
        """The prefill or decode-capable node of that id; None when it is neither."""
        for terms in (self.prefill, self.decode):
            i = terms.index.get(node_id)
            if i is not None:
                return terms.nodes[i]
        return None
