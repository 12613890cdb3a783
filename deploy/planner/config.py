"""The planner's one frozen config and its flags, shared by ``splitserve planner`` (flags
as named) and ``splitserve up --planner`` (the same flags prefixed ``--planner-``; the
routers and Redis are the cluster's own).

Owns flags -> ``PlannerConfig``; must not start anything.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ...common.auth import add_cluster_token_args, cluster_token_from_args
from .sim_profiles import SimDeployment, get_deployment
from .scaling import Bounds, PolicyConfig
from .slo import Slo, add_slo_args, slo_from_args

UP_SLO_MS = (5000.0, 500.0)  # up --planner's default TTFT and ITL bounds: the bundled model on this CPU


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    profile: str  # a profile or deployment of deploy/planner/sim_profiles.toml the nodes stand for
    slo: Slo
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    interval_s: float = 30.0  # wall seconds between decisions
    window: int = 6  # moving average: intervals
    ahead: int = 1  # intervals the forecast looks ahead (a new node's start-up time)
    time_scale: float = 1.0  # a simulated cluster's --sim-speedup: profile seconds per wall second
    router_urls: tuple[str, ...] = ()
    redis_url: str | None = field(default=None, repr=False)  # may hold a password
    # Presented on the routers' /metrics (what --protect-metrics accepts besides an API key).
    cluster_token: str | None = field(default=None, repr=False)
    model: str | None = None  # count only nodes serving this model (None: all)
    host: str = "127.0.0.1"
    port: int = 0  # /metrics, /debug/planner, /health (0: a free port)
    history: int = 200  # decisions kept for /debug/planner
    export_only: bool = False  # publish the targets, start and stop nothing (`splitserve planner`: Kubernetes)

    def __post_init__(self):
        if self.interval_s <= 0 or self.time_scale <= 0:
            raise ValueError("planner: interval and time scale must be > 0")
        if self.history < 1:
            raise ValueError("planner: history must be >= 1")

    @property
    def deployment(self) -> SimDeployment:
        return get_deployment(self.profile)


def add_planner_args(p: argparse.ArgumentParser, prefix: str = "", standalone: bool = True) -> None:
    """The planner's flags, each ``--<prefix><name>``; ``standalone`` adds where the
    routers and Redis are and the HTTP address (``up`` knows its own)."""
    g = p.add_argument_group("planner")
    f = lambda name: f"--{prefix}{name}"  # noqa: E731
    g.add_argument(f("profile"), default="smollm2-135m-cpu",
                   help="the profile or deployment the nodes run as (splitserve sim-nodes --list-profiles): "
                        "the model the pools are sized with (default: this CPU's bundled-model fit)")
    g.add_argument(f("interval"), type=float, default=30.0, help="seconds between decisions")
    g.add_argument(f("cooldown-up"), type=float, default=30.0,
                   help="seconds after a pool changed before it grows again")
    g.add_argument(f("cooldown-down"), type=float, default=120.0,
                   help="seconds after a pool changed before it shrinks")
    g.add_argument(f("down-after"), type=int, default=2,
                   help="decisions in a row that want fewer nodes before one is drained")
    g.add_argument(f("up-after"), type=int, default=1,
                   help="decisions in a row that want more nodes before they start (at once when the last "
                        "interval missed the SLO)")
    bounds = ("" if standalone else " (a node of --prefill-dp / --decode-dp N counts N: the planner "
              "starts and drains its ranks together, so the bounds are rounded to whole nodes)")
    g.add_argument(f("min-prefill"), type=int, default=1, help="the fewest prefill nodes" + bounds)
    g.add_argument(f("max-prefill"), type=int, default=8, help="the most prefill nodes")
    g.add_argument(f("min-decode"), type=int, default=1, help="the fewest decode nodes")
    g.add_argument(f("max-decode"), type=int, default=8, help="the most decode nodes")
    g.add_argument(f("min-samples"), type=int, default=5,
                   help="requests an interval needs before it moves the observed/predicted correction")
    g.add_argument(f("predict-window"), type=int, default=6, help="moving-average window, in intervals")
    g.add_argument(f("predict-ahead"), type=int, default=1,
                   help="intervals ahead the pools are sized for (a new node's start-up time)")
    g.add_argument(f("time-scale"), type=float, default=1.0,
                   help="simulated nodes' --sim-speedup: the profile's seconds per wall-clock second")
    if standalone:
        g.add_argument("--router-url", action="append", default=None,
                       help="a router to scrape (repeatable); each host is resolved to all its addresses, "
                            "so a headless Service names every router pod")
        g.add_argument("--redis-url", default=None,
                       help="the node registry (default: $SPLITSERVE_REDIS_URL)")
        g.add_argument("--model", default=None, help="count only nodes of this served model")
        add_cluster_token_args(g)  # the routers' /metrics under --protect-metrics
        g.add_argument("--host", default="127.0.0.1", help="bind address of /metrics and /debug/planner")
    g.add_argument(f("port"), type=int, default=8200 if standalone else 0,
                   help="port of /metrics and /debug/planner" + ("" if standalone else " (default: a free one)"))
    add_slo_args(p, prefix, None if standalone else UP_SLO_MS)


def dp_bounds(lo: int, hi: int, ranks: int, role: str, prefix: str = "") -> tuple[int, int]:
    """A pool's bounds (``--<prefix>min-<role>`` and ``max-``, in ranks: each rank is a node of the
    pool) for nodes of ``ranks`` data-parallel ranks: whole nodes, the least rounded up and the
    most down. Raises ValueError naming the flags when not even one node fits."""
    if ranks == 1:
        return lo, hi
    if hi < ranks:
        raise ValueError(f"--{prefix}max-{role} {hi}: a {role} node of --{role}-dp {ranks} is {ranks} ranks "
                         f"and the planner starts and drains it whole; the bounds count ranks: give "
                         f"--{prefix}max-{role} {ranks} or a larger multiple of {ranks}")
    return -(-lo // ranks) * ranks, hi // ranks * ranks


def planner_config(args: argparse.Namespace, prefix: str = "", dp: dict[str, int] | None = None,
                   **given) -> PlannerConfig:
    """The config of ``add_planner_args``'s flags; ``given`` fills what the caller knows
    (``up``: router_urls, redis_url, model, cluster_token); ``dp``: role -> data-parallel ranks
    of one node (``up --prefill-dp / --decode-dp``; default 1), the bounds rounded to whole nodes."""
    key = prefix.replace("-", "_")
    a = lambda name: getattr(args, key + name)  # noqa: E731
    get_deployment(a("profile"))  # an unknown name fails here, naming the choices
    ranks = {"prefill": 1, "decode": 1, **(dp or {})}
    (min_p, max_p), (min_d, max_d) = (dp_bounds(a(f"min_{role}"), a(f"max_{role}"), ranks[role], role, prefix)
                                      for role in ("prefill", "decode"))
    policy = PolicyConfig(bounds=Bounds(min_p, max_p, min_d, max_d),
                          cooldown_up_s=a("cooldown_up"), cooldown_down_s=a("cooldown_down"),
                          down_after=a("down_after"), up_after=a("up_after"), min_samples=a("min_samples"),
                          prefill_dp=ranks["prefill"], decode_dp=ranks["decode"])
    if "router_urls" not in given:
        from ...common.auth import redis_url_from
        if not args.router_url:
            raise ValueError("planner: give the routers to read, --router-url URL (repeatable)")
        given = dict(given, router_urls=tuple(args.router_url), redis_url=redis_url_from(args.redis_url),
                     model=args.model, host=args.host, export_only=True,
                     cluster_token=cluster_token_from_args(args))
    return PlannerConfig(profile=a("profile"), slo=slo_from_args(args, prefix), policy=policy,
                         interval_s=a("interval"), window=a("predict_window"), ahead=a("predict_ahead"),
                         time_scale=a("time_scale"), port=a("port"), **given)
