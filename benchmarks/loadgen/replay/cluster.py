"""A simulated cluster whose prefill and decode nodes stand for different profiles
(a deployment of deploy/planner/sim_profiles.toml, e.g. prefill TP4 / decode TP8).

deploy/launcher.py's SimCluster starts ``fleet_procs`` ``splitserve sim-nodes``
processes, each with a share of both roles and the same arguments; ``sim-nodes
--profile`` takes one profile per process. So each of those processes becomes two
here, one per role, each with its role's ``--profile``::

    fleet-i          sim-nodes ... --prefill-nodes a --decode-nodes 0 --profile P
    fleet-i-decode   sim-nodes ... --prefill-nodes 0 --decode-nodes b --profile D

(node ids stay ``f<i>-<role>-<j>``). Owns only that split; everything else (Redis,
the router, how a process is started and waited for) is SimCluster's. Until
``sim-nodes`` takes a deployment itself (node/sim_fleet.py's ``fleet_configs``
already builds the nodes of one from two templates), this is how a replay runs one.
"""

from __future__ import annotations

from splitserve.deploy.planner.sim_profiles import SimDeployment
from splitserve.deploy.launcher import Proc, SimCluster

ROLES = ("prefill", "decode")


class DeploymentSimCluster(SimCluster):
    """``SimCluster`` with the prefill nodes on ``deployment.prefill``'s profile and the
    decode nodes on ``deployment.decode``'s; ``sim_args`` (no ``--profile``: the
    deployment gives each role its own) go to every fleet process."""

    def __init__(self, deployment: SimDeployment, prefill_nodes: int, decode_nodes: int,
                 fleet_procs: int = 2, sim_args=(), **kwargs):
        if "--profile" in sim_args:
            raise ValueError("DeploymentSimCluster: sim_args must not hold --profile; the deployment "
                             "gives each role its own")
        super().__init__(prefill_nodes, decode_nodes, fleet_procs, sim_args, **kwargs)
        self.deployment = deployment

    def _spawn(self, name: str, args: list[str], role: str) -> Proc:
        """A fleet process of both roles -> one process per role with nodes; the first
        is returned (``start`` waits for every node in the router's /health). A fleet
        that already has its ``--profile`` (a respawn) starts as it was."""
        counts = {r: int(args[args.index(f"--{r}-nodes") + 1]) for r in ROLES} if role == "fleet" else {}
        if not any(counts.values()) or "--profile" in args:
            return super()._spawn(name, args, role)
        procs: list[Proc] = []
        for r in (r for r in ROLES if counts[r]):
            one = list(args)
            for other in ROLES:
                one[one.index(f"--{other}-nodes") + 1] = str(counts[other] if other == r else 0)
            profile = self.deployment.prefill if r == "prefill" else self.deployment.decode
            procs.append(super()._spawn(name if not procs else f"{name}-{r}", [*one, "--profile", profile.name],
                                        role))
        return procs[0]

    def start(self, timeout: float = 180.0) -> "DeploymentSimCluster":
        try:
            super().start(timeout)
        except BaseException:
            self.stop()  # a process that never registered must not outlive the failed start
            raise
        return self
