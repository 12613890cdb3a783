"""When a local cluster (``splitserve up``, the tests' clusters) serves, so ``up`` prints
its URL only then and a first request finds every node:

    1. every member printed its READY line (it listens);
    2. every node member has registered itself: the node registry record under its node id
       (common/node_registry.py) names the address it printed, not one a node of an earlier
       run left behind (a Redis that refuses writes, full or read-only, fails here);
    3. one router poll of the node registry later (ROUTER_POLL_S), every router's /health says
       ok and counts, role by role, at least the nodes started.

One deadline for all of it (``up --startup-timeout``); past it, ``NotServing`` names each
member still missing and why. A member that exits meanwhile fails the start at once,
with its last lines.

Must not start or stop anything (deploy/launcher.py does).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

import msgspec

from ..common.node_registry import NodeInfo, node_key
from ..router.config import RouterConfig
from .member import Proc

ROUTER_POLL_S = RouterConfig().poll_interval_s  # how often a router re-reads the node registry
CHECK_EVERY_S = 0.2


class NotServing(RuntimeError):
    """The cluster did not come up; the message names who is missing."""


def wait_serving(members: Sequence[Proc], nodes: Mapping[str, Proc], router_urls: Sequence[str],
                 roles: Mapping[str, int], redis_url: str | None, timeout_s: float) -> None:
    """Until the cluster serves (the module's three steps); ``nodes``: node id -> its member
    (empty: nodes the node registry check cannot name, as a simulated fleet's). Raises
    NotServing."""
    deadline = time.monotonic() + timeout_s
    registered_at: float | None = None
    while True:
        for m in members:
            if (code := m.popen.poll()) is not None:
                raise NotServing(f"{m.name} exited with {code} while starting:\n" + "\n".join(m.log[-20:]))
        missing = [f"{m.name} (no READY line yet)" for m in members if not m.ready.is_set()]
        if not missing:
            missing = unregistered(nodes, redis_url)
        if missing:
            registered_at = None
        elif registered_at is None:
            registered_at = time.monotonic()
        if registered_at is not None and time.monotonic() >= registered_at + ROUTER_POLL_S:
            missing = [why for url in router_urls if (why := router_missing(url, roles)) is not None]
            if not missing:
                return
        if time.monotonic() > deadline:
            raise NotServing(f"not serving after {timeout_s:g}s: " + "; ".join(missing or ["routers"]))
        time.sleep(CHECK_EVERY_S)


def unregistered(nodes: Mapping[str, Proc], redis_url: str | None) -> list[str]:
    """Why each of ``nodes`` (node id -> member) is not registered under the address it
    printed; [] when all are."""
    if not nodes or redis_url is None:
        return []
    import redis
    ids = list(nodes)
    try:
        with redis.Redis.from_url(redis_url, socket_timeout=1, socket_connect_timeout=1) as r:
            raw = r.mget([node_key(i) for i in ids])
    except (redis.RedisError, OSError) as e:
        return [f"Redis unreachable ({type(e).__name__}), so no node is known registered"]
    out = []
    for node_id, record in zip(ids, raw):
        addr = msgspec.msgpack.decode(record, type=NodeInfo).http_addr if record else None
        if addr != nodes[node_id].addr:
            out.append(f"{nodes[node_id].name} (not registered in Redis" +
                       (f": the record there names {addr}, a node of an earlier run" if addr else "") +
                       "; is Redis full or read-only? the node's log says)")
    return out


def router_missing(url: str, roles: Mapping[str, int]) -> str | None:
    """Why the router at ``url`` does not serve ``roles`` (role -> nodes) yet; None when it does."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            health = json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503: no decode node yet, or draining
        health = json.loads(e.read() or b"{}")
    except (OSError, ValueError) as e:
        return f"router {url} does not answer /health ({type(e).__name__})"
    short = [f"{health.get(f'{role}_nodes', 0)} of {n} {role} nodes" for role, n in roles.items()
             if n and health.get(f"{role}_nodes", 0) < n]
    if short or health.get("status") != "ok":
        return f"router {url} sees " + (", ".join(short) or f"status {health.get('status')!r}")
    return None
