"""The routing policies by name (``--policy``): the one place that maps a name to
its policy.

Owns the mapping and building a policy from the router's config. Must not be
imported by a policy (it imports them all). config.py keeps the names the command
line accepts (`POLICIES`); a module-level check keeps the two lists equal.
"""

from __future__ import annotations

from collections.abc import Callable

from .cache_aware import CacheAware
from ..config import POLICIES, CacheAwareWeights
from .load_policies import LeastLoad, RoundRobin
from .policy import RoutingPolicy

# name -> builder from the cache_aware weights (the load-only policies take none)
BUILDERS: dict[str, Callable[[CacheAwareWeights], RoutingPolicy]] = {
    CacheAware.name: CacheAware,
    LeastLoad.name: lambda _weights: LeastLoad(),
    RoundRobin.name: lambda _weights: RoundRobin(),
}
assert tuple(BUILDERS) == POLICIES, "config.POLICIES must name exactly the registered policies"


def make_policy(name: str, weights: CacheAwareWeights | None = None) -> RoutingPolicy:
    """A new policy called ``name``; ``weights`` configure cache_aware (default: the
    defaults). Raises ValueError naming the setting for an unknown name."""
    builder = BUILDERS.get(name)
    if builder is None:
        raise ValueError(f"policy: unknown routing policy {name!r}; use {', '.join(BUILDERS)}")
    return builder(weights or CacheAwareWeights())
