"""The policy registry: the routing policies by name (``--policy``), the one place that says
which policies exist, and the building of one from the router's config.

A policy is one ``PolicySpec``; the built-in ones are ``BUILTIN`` (cache_aware.py, the
default, and load_policies.py). A policy from outside the package is a module named in the
environment variable ``SPLITSERVE_ROUTING_POLICIES`` (comma-separated module names or
``.py`` paths, as ``$SPLITSERVE_MODEL_FAMILIES``) that defines ``POLICY``, a ``PolicySpec``;
the router loads them on its first lookup (``splitserve up``'s routers inherit the
variable). The router's ``--policy`` choices (cli.py), its build (app.py: an unknown name
is refused before anything binds) and the replay tools read this registry.

Owns the specs and building a policy. Must not be imported by a policy (it imports them
all); router/config.py sits below the policies, so it cannot read this registry: the
router checks ``RouterConfig.policy`` here when it builds its app.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from ...common.plugins import load_specs, merge
from .cache_aware import CacheAware
from ..config import POLICIES_ENV, CacheAwareWeights
from .load_policies import LeastLoad, RoundRobin
from .policy import RoutingPolicy



@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One routing policy: ``build(weights)`` makes a new one (``weights``: --score-weights,
    which only cache_aware reads) whose ``name`` is the spec's. A router builds one per app."""

    name: str  # the --policy value; /debug/decisions names it on every decision
    build: Callable[[CacheAwareWeights], RoutingPolicy]

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip() or not callable(self.build):
            raise ValueError(f"PolicySpec: needs a name and a build(weights) callable, got {self.name!r}")


BUILTIN = (
    PolicySpec(CacheAware.name, CacheAware),
    PolicySpec(LeastLoad.name, lambda _weights: LeastLoad()),  # the load-only policies take no weights
    PolicySpec(RoundRobin.name, lambda _weights: RoundRobin()),
)


def policy_names() -> tuple[str, ...]:
    """Every policy's name, the built-ins first (the default, cache_aware, first of all)."""
    return tuple(_specs(os.environ.get(POLICIES_ENV, "")))


def policy_spec(name: str) -> PolicySpec:
    """The policy called ``name``; raises ValueError naming the setting and the choices."""
    specs = _specs(os.environ.get(POLICIES_ENV, ""))
    if name not in specs:
        raise ValueError(f"policy: unknown routing policy {name!r}; use {', '.join(specs)} (a policy of "
                         f"your own: ${POLICIES_ENV}, see README.md)")
    return specs[name]


def make_policy(name: str, weights: CacheAwareWeights | None = None) -> RoutingPolicy:
    """A new policy called ``name``; ``weights`` configure cache_aware (default: the
    defaults). Raises ValueError naming the setting for an unknown name."""
    spec = policy_spec(name)
    policy = spec.build(weights or CacheAwareWeights())
    if getattr(policy, "name", None) != spec.name:
        raise ValueError(f"{POLICIES_ENV}: policy {spec.name!r} built a policy named "
                         f"{getattr(policy, 'name', None)!r}; its name must be the spec's")
    return policy


@cache
def _specs(value: str) -> dict[str, PolicySpec]:
    """name -> spec: the built-ins, then each module of ``value`` ($SPLITSERVE_ROUTING_POLICIES)."""
    loaded = load_specs(POLICIES_ENV, value, "POLICY", PolicySpec, "splitserve_policy")
    return merge(POLICIES_ENV, BUILTIN, loaded, lambda s: s.name)
