"""A routing policy from outside the package, in one file, as a user adds one (README.md,
"Adding a KV backend or a routing policy"): tests/test_plugins.py names this file in
$SPLITSERVE_ROUTING_POLICIES.

The toy policy, ``toy_least_kv``, routes by memory rather than by queue: the decode node
with the least KV cache in use (then the fewest requests, counting this router's in flight
there), and the prefill node, among those that can send it KV, with the fewest prompt
tokens still to compute (its heartbeat's queue, or this router's work sent there when
larger). Ties go to the first node id, never rotate; it ignores the prefix index.
"""

from collections.abc import Mapping, Sequence

from splitserve.common.node_registry import NodeInfo
from splitserve.router.routing.kv_pairing import compatible_prefills
from splitserve.router.routing.node_terms import split_roles
from splitserve.router.routing.policy import NO_CACHED, NO_INFLIGHT, NO_TIERS, Decision
from splitserve.router.routing.policy_registry import PolicySpec
from splitserve.router.routing.recent_work import RecentWork
from splitserve.router.routing.tier_cost import TierBlocks

NAME = "toy_least_kv"


class LeastKV:
    """``RoutingPolicy``: the least KV in use, then the fewest requests; ties by node id."""

    name = NAME
    uses_prefix_index = False
    recent: RecentWork | None = None

    def choose(self, request_token_ids: Sequence[int], nodes: Sequence[NodeInfo],
               inflight: Mapping[str, int] = NO_INFLIGHT, *,
               cached: Mapping[str, int] = NO_CACHED,
               inflight_tokens: Mapping[str, int] = NO_INFLIGHT,
               tie_key: int | None = None,
               tiers: Mapping[str, TierBlocks] = NO_TIERS, **more: object) -> Decision | None:
        prefills, decodes = split_roles(nodes)
        if not decodes:
            return None
        decode = min(decodes, key=lambda n: (n.load.kv_usage, max(n.load.running + n.load.waiting,
                                                                    inflight.get(n.node_id, 0)), n.node_id))
        prefill = min(compatible_prefills(prefills, decode), default=None,
                      key=lambda n: (max(n.load.queued_prefill_tokens, inflight_tokens.get(n.node_id, 0)),
                                     n.node_id))
        return Decision(prefill, decode, len(request_token_ids))


POLICY = PolicySpec(NAME, lambda _weights: LeastKV())
