"""What a prefix pull costs on its holder's side, from the holder's heartbeat and this
router's own pulls from it: the holder serves all its pulls from one budget
(node/pull_budget.py), so a pull from a holder already serving others, or busy with its own
requests, is slower than its bytes alone say.

    pulls(h)   the pulls h serves: max(its heartbeat's ``NodeLoad.pulls_serving``, this
               router's pulls from it that have not reached their first token)
    share(h)   1 + pulls(h): the pulls one more would share h's copies and outgoing link with
    copy(h)    block_bytes / (pull_bytes_per_s(h) / share(h)): seconds h takes to copy a block
               out for one more pull. ``pull_bytes_per_s``: the rate h measured on its pulls'
               chunks, times PULL_STEP_SHARE while it runs requests (a busy holder lends a
               tenth of its steps), all its pulls together
    recompute  block_bytes / h's recompute rate (its device tier's load rate; tier_cost.py's
               default where it reports none): the unit of a token-equivalent
    ratio(h)   copy(h) / recompute: the copy's cost as a share of recomputing the block; 0.0
               where h has measured no copy yet (an idle holder, an older node)

router/routing/cache_aware.py weighs the pull's transfer by share(h) and adds ratio(h) x the
work the pull saves (``PullPlan``). Owns these two numbers; must not weigh them against load
or do I/O.
"""

from __future__ import annotations

from typing import NamedTuple

from ...common.kv_events import Tier
from ...common.node_registry import NodeInfo
from .tier_cost import RECOMPUTE_BYTES_PER_S


class PullCost(NamedTuple):
    share: int  # share(h): one more pull and those h serves
    ratio: float  # ratio(h): a block's copy out of h over its recompute time


def pull_cost(holder: NodeInfo, router_pulls: int = 0) -> PullCost:
    """``holder``'s share and copy ratio for one more pull (``router_pulls``: this router's
    pulls from it in flight)."""
    load = holder.load
    share = 1 + max(load.pulls_serving, router_pulls)
    if load.pull_bytes_per_s <= 0:
        return PullCost(share, 0.0)
    device = next((t for t in holder.tiers if t.tier is Tier.DEVICE), None)
    recompute = device.load_bytes_per_s if device is not None and device.load_bytes_per_s > 0 \
        else RECOMPUTE_BYTES_PER_S
    return PullCost(share, share * recompute / load.pull_bytes_per_s)
