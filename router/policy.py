"""Routing policies: which decode node (and which prefill node, if any) serves a
request.

Owns the `RoutingPolicy` interface and the load-only policies (cache_aware.py has
the default one). A policy sees the request's prompt token ids, the live nodes of
the served model, how many of this router's requests (and prompt tokens) are in
flight on each node and, if it ``uses_prefix_index``, the predicted cached prompt
tokens per node; it returns a `Decision`, or None when no decode-capable node
exists. Must not do I/O (the node list comes from discovery.py, the predicted hits
from prefix_index.py) or keep per-request state.

Load is a node's last heartbeat (up to a poll interval plus a heartbeat old) or,
when larger, this router's own in-flight count on it, which is always fresh: a
burst between two heartbeats then spreads instead of piling onto the node that
looked idle.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple, Protocol

from ..common.registry import NodeInfo
from .config import CacheAwareWeights

NO_INFLIGHT: Mapping[str, int] = MappingProxyType({})
NO_CACHED: Mapping[str, int] = MappingProxyType({})


class Decision(NamedTuple):
    prefill: NodeInfo | None  # None: the decode node prefills locally
    decode: NodeInfo
    # What the prefill node (or the decode node prefilling locally) will compute, in
    # token-equivalents; dispatch counts it in flight there until the first token.
    prefill_work: float = 0.0
    # The policy's TTFT prediction in token-equivalents (work queued ahead + this
    # request's work + the hop); None: the policy does not predict (load-only ones).
    predicted_ttft: float | None = None
    predicted_ttft_s: float | None = None  # the same in seconds, when the policy knows the rate


class RoutingPolicy(Protocol):
    name: str
    uses_prefix_index: bool  # dispatch looks up `cached` only for policies that use it

    def choose(self, request_token_ids: Sequence[int], nodes: Sequence[NodeInfo],
               inflight: Mapping[str, int] = NO_INFLIGHT, *,
               cached: Mapping[str, int] = NO_CACHED,
               inflight_tokens: Mapping[str, int] = NO_INFLIGHT,
               tie_key: int | None = None) -> Decision | None:
        """Pick nodes for one request. ``inflight``: node_id -> requests this router
        has in flight there (for prefill nodes: not yet past their first token);
        ``inflight_tokens``: node_id -> their prefill work still to do there (the
        ``Decision.prefill_work`` of each, in token-equivalents);
        ``cached``: node_id -> predicted cached prompt tokens (absent: none);
        ``tie_key``: breaks ties among equal nodes the same way for the same key (router
        replicas agree), None: ties rotate."""
        ...


def split_roles(nodes: Sequence[NodeInfo]) -> tuple[list[NodeInfo], list[NodeInfo]]:
    """(prefill nodes, decode-capable nodes)."""
    return ([n for n in nodes if n.role == "prefill"], [n for n in nodes if n.decode_capable])


def decode_load(node: NodeInfo, inflight: Mapping[str, int]) -> tuple:
    """Sort key, smaller is less loaded: requests on the node, then KV usage."""
    reported = node.load.running + node.load.waiting
    return (max(reported, inflight.get(node.node_id, 0)), node.load.kv_usage)


def prefill_load(node: NodeInfo, inflight: Mapping[str, int]) -> tuple:
    """Sort key: requests still prefilling there, then prompt tokens still queued."""
    reported = node.load.running + node.load.waiting
    return (max(reported, inflight.get(node.node_id, 0)), node.load.queued_prefill_tokens)


class LeastLoad:
    """The least loaded decode node and the least loaded prefill node. Ties rotate,
    so equally idle nodes share a burst."""

    name = "least_load"
    uses_prefix_index = False

    def __init__(self):
        self._tie = itertools.count()

    def choose(self, request_token_ids, nodes, inflight=NO_INFLIGHT, *, cached=NO_CACHED,
               inflight_tokens=NO_INFLIGHT, tie_key=None):
        prefills, decodes = split_roles(nodes)
        if not decodes:
            return None
        turn = next(self._tie) if tie_key is None else tie_key
        decode = _least(decodes, decode_load, inflight, turn)
        assert decode is not None  # decodes is not empty
        return Decision(_least(prefills, prefill_load, inflight, turn), decode, len(request_token_ids))


class RoundRobin:
    """Decode and prefill nodes in turn, ignoring load."""

    name = "round_robin"
    uses_prefix_index = False

    def __init__(self):
        self._turn = itertools.count()

    def choose(self, request_token_ids, nodes, inflight=NO_INFLIGHT, *, cached=NO_CACHED,
               inflight_tokens=NO_INFLIGHT, tie_key=None):
        prefills, decodes = split_roles(nodes)
        if not decodes:
            return None
        turn = next(self._turn)  # ignores tie_key: it rotates by design
        return Decision(prefills[turn % len(prefills)] if prefills else None,
                        decodes[turn % len(decodes)], len(request_token_ids))


def _least(nodes: list[NodeInfo], key, inflight: Mapping[str, int], turn: int) -> NodeInfo | None:
    if not nodes:
        return None
    keys = [key(n, inflight) for n in nodes]
    best = min(keys)
    tied = [n for n, k in zip(nodes, keys) if k == best]
    return tied[turn % len(tied)]


def make_policy(name: str, weights: CacheAwareWeights | None = None) -> RoutingPolicy:
    """The policy called ``name``; ``weights`` configure cache_aware."""
    if name == "cache_aware":
        from .cache_aware import CacheAware  # it builds on this module
        return CacheAware(weights)
    if name == "least_load":
        return LeastLoad()
    if name == "round_robin":
        return RoundRobin()
    raise ValueError(f"policy: unknown routing policy {name!r}; use cache_aware, least_load "
                     "or round_robin")
