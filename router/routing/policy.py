"""The routing policy interface: what a policy is given and what it answers.

    Decision        the nodes chosen for one request (a prefill node or none, a decode
                    node, a prefix to pull first or none) and the policy's prediction
    RoutingPolicy   ``choose`` over the live nodes; ``uses_prefix_index`` and ``recent``
                    tell the dispatcher and the app what the policy needs from them

The policies live in load_policies.py (least_load, round_robin) and cache_aware.py
(the default); policy_registry.py maps their names to them. Owns the interface only:
must not import a policy, so every policy can import it.

Load is a node's last heartbeat (up to a poll interval plus a heartbeat old) or,
when larger, this router's own in-flight count on it, which is always fresh: a
burst between two heartbeats then spreads instead of piling onto the node that
looked idle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from ...common.node_registry import NodeInfo
from .recent_work import RecentWork
from .tier_cost import TierBlocks

NO_INFLIGHT: Mapping[str, int] = MappingProxyType({})
NO_CACHED: Mapping[str, int] = MappingProxyType({})
NO_TIERS: Mapping[str, TierBlocks] = MappingProxyType({})


class PullPlan(NamedTuple):
    """A prefix the node computing the prompt pulls first (node/kv_pull.py)."""
    holder: NodeInfo  # the node predicted to cache it
    tokens: int  # its predicted cached prefix of the prompt (whole blocks)
    holder_load: float = 0.0  # token-equivalents of the holder's loads of the part it keeps below its device
    share: int = 1  # the pulls sharing the holder's copies and link with this one (router/routing/pull_cost.py)
    copy_ratio: float = 0.0  # the holder's copy of a block for it over recomputing the block


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
    pull: PullPlan | None = None  # the prefix the computing node pulls first; None: it pulls nothing


class RoutingPolicy(Protocol):
    """Picks nodes for one request. Must not do I/O (the node list comes from
    discovery.py, the predicted hits from prefix_mirror.py) or keep per-request state."""

    name: str
    uses_prefix_index: bool  # dispatch looks up `cached` only for policies that use it

    @property
    def recent(self) -> RecentWork | None:
        """The recent prefill work per node the policy weighs, which the app shares with
        the other router replicas (shared_work.py); None: the policy keeps none."""
        ...

    def choose(self, request_token_ids: Sequence[int], nodes: Sequence[NodeInfo],
               inflight: Mapping[str, int] = NO_INFLIGHT, *,
               cached: Mapping[str, int] = NO_CACHED,
               inflight_tokens: Mapping[str, int] = NO_INFLIGHT,
               tie_key: int | None = None,
               tiers: Mapping[str, TierBlocks] = NO_TIERS,
               pulls: Mapping[str, int] = NO_INFLIGHT, **more: Any) -> Decision | None:
        """Pick nodes for one request; None when no decode-capable node exists.
        ``inflight``: node_id -> requests this router has in flight there (for prefill
        nodes: not yet past their first token); ``inflight_tokens``: node_id -> their
        prefill work still to do there (the ``Decision.prefill_work`` of each, in
        token-equivalents); ``cached``: node_id -> predicted cached prompt tokens
        (absent: none); ``tiers``: node_id -> those tokens' blocks by the tier holding
        each (absent: all on the device); ``pulls``: node_id -> this router's prefix pulls
        from it not yet at their first token; ``tie_key``: breaks ties among equal nodes the
        same way for the same key (router replicas agree), None: ties rotate. ``more``: what
        later routers pass beside these (a policy ignores what it does not know, so a policy
        written today keeps working when the dispatcher learns a new input)."""
        ...
