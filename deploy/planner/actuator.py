"""How a planning decision reaches the pools.

    LocalPools   ``splitserve up --planner`` (and the simulated clusters of the planner
                 benchmarks): starts nodes of the launcher's Cluster whole
                 (``start_members``: a fresh node number each, never reused: a draining
                 node keeps its ids until it is gone) and scales down by
                 ``Cluster.retire_members``: the least loaded node of the role (its
                 heartbeat: running + waiting + queued tokens; a node not yet registered
                 counts as idle) gets SIGTERM and drains (503 to new work, deregistered,
                 index entries withdrawn, in-flight requests finish within its
                 --drain-grace; the router retries a refused request on another node and
                 migrates what outlives the grace)
    ExportOnly   Kubernetes: changes nothing; the planner's targets leave as metrics
                 (``splitserve:planner_target_replicas{role}``) that the HPAs follow

A data-parallel node (``up --prefill-dp / --decode-dp N``) is N members, each rank a node of
the pool (the node registry's and the profiles' unit): the policy counts ranks and changes a pool
by whole nodes of N (scaling.py), and LocalPools starts the N ranks of a node together (they
meet at the node's own rendezvous) and retires them together (they drain together and stop
at one agreed turn: engine/engine_thread.py); the least loaded node is the one whose ranks
carry the least load together. A lone rank is never started or retired.

Both count a role's nodes as those serving or starting, never those draining. LocalPools
also keeps each node's life (start to exit, draining included) for the device-seconds a
run cost. Must not decide anything (scaling.py does).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from subprocess import Popen
from typing import Protocol

from ...common.node_registry import NodeInfo

ROLES = ("prefill", "decode")


class Member(Protocol):
    name: str

    @property
    def popen(self) -> Popen: ...


class Cluster(Protocol):
    """What LocalPools uses of deploy/launcher.py's Cluster (which starts ``up --planner``'s
    planner, so it is named here, not imported)."""
    @property
    def procs(self) -> Sequence[Member]: ...
    @property
    def retired(self) -> set[str]: ...
    def node(self, name: str) -> Member: ...
    def dp_size(self, role: str) -> int: ...
    def start_members(self, role: str, node: int) -> Sequence[Member]: ...
    def retire_members(self, role: str, node: int) -> list[str]: ...
    def node_id_of(self, name: str) -> str: ...


class Actuator(Protocol):
    kind: str

    def counts(self, nodes: list[NodeInfo]) -> dict[str, int]: ...  # role -> serving or starting
    async def apply(self, change: dict[str, int], nodes: list[NodeInfo]) -> list[str]: ...  # what it did
    def state(self) -> dict: ...  # for /debug/planner


class ExportOnly:
    """Counts the node registry's live nodes; applies nothing (the HPAs act on the exported targets)."""
    kind = "export"

    def counts(self, nodes: list[NodeInfo]) -> dict[str, int]:
        return {role: sum(n.role == role for n in nodes) for role in ROLES}

    async def apply(self, change: dict[str, int], nodes: list[NodeInfo]) -> list[str]:
        return []

    def state(self) -> dict:
        return {"kind": self.kind}


@dataclass(slots=True)
class NodeLife:
    name: str  # the launcher's member name, <role>-<index>
    role: str
    node_id: str
    node: int  # the node it is a rank of (index // the role's data-parallel size; its index at DP 1)
    started: float  # monotonic
    drain_started: float | None = None
    stopped: float | None = None
    exit_code: int | None = None  # 0: it drained and exited cleanly


class LocalPools:
    """Starts and drains the node members of ``cluster`` (its supervisor keeps running
    them); ``gpus`` (role -> devices one node holds) weighs the device-seconds."""
    kind = "local"

    def __init__(self, cluster: Cluster, gpus: dict[str, int] | None = None, clock=time.monotonic):
        self.cluster, self.clock = cluster, clock
        self.gpus = {role: max(1, (gpus or {}).get(role, 1)) for role in ROLES}
        self._lock = threading.Lock()
        now = clock()
        self.lives: dict[str, NodeLife] = {}  # member name -> its life
        for p in cluster.procs:
            role = _role(p.name)
            if role is not None and p.name not in cluster.retired:
                self.lives[p.name] = self._life(p.name, role, now)
        self.actions: list[dict] = []  # what apply did, oldest first (kept whole for the benchmarks)

    def _life(self, name: str, role: str, now: float) -> NodeLife:
        node = int(name.rsplit("-", 1)[1]) // self.cluster.dp_size(role)
        return NodeLife(name, role, self.cluster.node_id_of(name), node, now)

    def _serving(self, role: str) -> list[NodeLife]:
        return [n for n in self.lives.values() if n.role == role and n.drain_started is None]

    def _serving_nodes(self, role: str) -> dict[int, list[NodeLife]]:
        """node -> its serving ranks (every rank of a node serves or drains with the others)."""
        nodes: dict[int, list[NodeLife]] = {}
        for n in self._serving(role):
            nodes.setdefault(n.node, []).append(n)
        return nodes

    def counts(self, nodes: list[NodeInfo]) -> dict[str, int]:
        self.poll()
        return {role: len(self._serving(role)) for role in ROLES}

    def poll(self) -> None:
        """Note the exit of draining nodes."""
        now = self.clock()
        with self._lock:
            for n in self.lives.values():
                if n.stopped is None and n.drain_started is not None:
                    code = self.cluster.node(n.name).popen.poll()
                    if code is not None:
                        n.stopped, n.exit_code = now, code

    async def apply(self, change: dict[str, int], nodes: list[NodeInfo]) -> list[str]:
        """``change``: role -> ranks to start (> 0) or drain (< 0), whole nodes of the role's
        data-parallel size (scaling.py rounds them)."""
        done = []
        load = {n.node_id: n.load.running + n.load.waiting + n.load.queued_prefill_tokens / 1000 for n in nodes}
        for role, n in change.items():
            size = self.cluster.dp_size(role)
            assert n % size == 0, f"{role}: a change of {n} ranks is not whole nodes of {size}"
            for _ in range(max(0, n) // size):
                node = 1 + max((x.node for x in self.lives.values() if x.role == role), default=-1)
                procs = await asyncio.to_thread(self.cluster.start_members, role, node)
                now = self.clock()
                with self._lock:
                    for proc in procs:
                        self.lives[proc.name] = self._life(proc.name, role, now)
                done.append(f"started {', '.join(p.name for p in procs)}")
            for _ in range(max(0, -n) // size):
                serving = self._serving_nodes(role)
                if len(serving) <= 1 and role == "decode":
                    break  # the last decode node never goes: nothing could serve
                # least loaded first (its ranks together); among equals the newest (a node not registered yet is idle)
                victim = min(serving, key=lambda node: (sum(load.get(x.node_id, 0.0) for x in serving[node]), -node))
                ranks = serving[victim]
                await asyncio.to_thread(self.cluster.retire_members, role, victim)
                now = self.clock()
                with self._lock:
                    for x in ranks:
                        x.drain_started = now
                carried = sum(load.get(x.node_id, 0.0) for x in ranks)
                done.append(f"draining {', '.join(x.name for x in ranks)} (load {carried:g})")
        if done:
            self.actions.append({"at": self.clock(), "did": done})
        return done

    def device_seconds(self, until: float | None = None) -> dict[str, float]:
        """role -> sum over its nodes of (exit or ``until`` - start) x devices per node."""
        until = self.clock() if until is None else until
        out = {role: 0.0 for role in ROLES}
        with self._lock:
            for n in self.lives.values():
                end = n.stopped if n.stopped is not None else until
                out[n.role] += max(0.0, end - n.started) * self.gpus[n.role]
        return out

    def state(self) -> dict:
        self.poll()
        now = self.clock()
        with self._lock:
            nodes = [{"name": n.name, "role": n.role, "node_id": n.node_id, "node": n.node,
                      "age_s": round(now - n.started, 1),
                      "state": "stopped" if n.stopped is not None else
                      "draining" if n.drain_started is not None else "serving", "exit_code": n.exit_code}
                     for n in self.lives.values()]
        return {"kind": self.kind, "nodes": nodes, "device_seconds": self.device_seconds(now),
                "recent_actions": self.actions[-20:]}


def _role(name: str) -> str | None:
    role, _, index = name.rpartition("-")
    return role if role in ROLES and index.isdigit() else None
