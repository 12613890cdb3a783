"""The planner's performance model of a deployment: how many prefill and how many decode
nodes a load needs within an SLO, from the simulated-node profiles' step-time model
(deploy/planner/sim_profiles.py: a GPU's roofline, or this CPU's fitted timing), each side
scaled by a correction the planner measures (observed over predicted latency).

Prefill pool: P nodes serving one queue (the router sends each prompt to the least
loaded node), prompts arriving Poisson at ``rate``; one prompt alone on a node takes
``s = corr_p x profile.prefill_seconds(isl)``. Erlang C (M/M/P, a conservative stand-in
for the nearly deterministic service) gives the wait::

    a = rate x s                     offered load: busy nodes on average (needs P > a)
    C = ErlangC(P, a)                probability that a prompt waits
    P(wait > t) = C exp(-(P - a) t / s)
    TTFT_q = s + max(0, s / (P - a) x ln(C / (1 - q))) + step_d / 2
             (step_d / 2: the first token leaves with the decode node's next step boundary)
    prefill nodes = the smallest P with TTFT_q <= slo.ttft_s

Decode pool: D nodes, requests in flight N = rate x osl x step (Little), so each node
runs ``b = rate x osl x step(b) / D`` requests (a fixed point), each step::

    step(b) = corr_d x profile step_seconds(decode_batch=b, context=b x (isl + osl / 2))
    decode nodes = the smallest D whose b converges with step(b) <= itl_headroom x slo.itl_s,
                   b x (isl + osl) + reserved / D <= kv_headroom x the KV cache, b <= the
                   step's token budget; reserved = rate x slo.ttft_s x isl: the prompt
                   blocks decode nodes hold for requests still queued for prefill

(``itl_headroom`` < 1 leaves room for the batch's swings: a request's ITL is the mean of
the steps it shares.) Output lengths are known only when requests finish, a request's
duration after a shift of the load, so ``decode_nodes_for`` also sizes the pool for the
requests the decode nodes hold now, and the policy takes the larger. Prefix-cache hits are not modelled: a cacheable load gets a
conservative size, and the observed-over-predicted correction takes the difference.

Owns the arithmetic; must not read metrics or start anything (scaling.py decides).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .sim_profiles import SimDeployment, SimProfile
from .slo import Slo

ITL_HEADROOM = 0.85  # a node's mean step at its planned batch stays this far under the ITL bound
KV_HEADROOM = 0.9  # of the KV cache the planned batch may fill (full contexts)


class PrefillSizing(NamedTuple):
    nodes: int
    service_s: float  # one prompt alone on a node, corrected
    offered: float  # rate x service_s: nodes busy on average
    ttft_q_s: float  # predicted TTFT at the SLO's quantile with ``nodes``
    feasible: bool  # False: even the most nodes allowed miss the SLO (``nodes`` is that maximum)


class DecodeSizing(NamedTuple):
    nodes: int
    batch: float  # requests running per decode node
    step_s: float  # predicted ITL: one step at that batch, corrected
    kv_share: float  # of one node's KV cache those requests fill (full contexts)
    feasible: bool


def erlang_c(servers: int, offered: float) -> float:
    """The probability that an arrival waits in an M/M/``servers`` queue of ``offered``
    load (1.0 when ``offered`` >= ``servers``)."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    term, total = 1.0, 1.0  # a^k / k!, summed for k < servers
    for k in range(1, servers):
        term *= offered / k
        total += term
    last = term * offered / servers * servers / (servers - offered)  # a^c / c! x c / (c - a)
    return last / (total + last)


class PoolModel:
    """The two pools of ``deployment`` against ``slo``. ``corr_p`` / ``corr_d`` (1.0: the
    profile as stated) stretch the prefill service and the decode step."""

    def __init__(self, deployment: SimDeployment, slo: Slo, itl_headroom: float = ITL_HEADROOM,
                 kv_headroom: float = KV_HEADROOM):
        self.deployment, self.slo = deployment, slo
        self.itl_headroom, self.kv_headroom = itl_headroom, kv_headroom
        self._prefill_sim = deployment.prefill.sim_config()
        self._decode_sim = deployment.decode.sim_config()

    @property
    def prefill(self) -> SimProfile:
        return self.deployment.prefill

    @property
    def decode(self) -> SimProfile:
        return self.deployment.decode

    # ---- prefill -------------------------------------------------------------------------------
    def prefill_seconds(self, isl: float, corr_p: float = 1.0) -> float:
        return corr_p * self.prefill.prefill_seconds(max(1, round(isl)))

    def ttft(self, rate: float, isl: float, nodes: int, corr_p: float = 1.0, corr_d: float = 1.0,
             q: float | None = None) -> float:
        """TTFT at quantile ``q`` (None: the mean) for ``rate`` prompts/s of ``isl`` tokens over
        ``nodes`` prefill nodes; inf when they cannot keep up."""
        s = self.prefill_seconds(isl, corr_p)
        a = rate * s
        if a >= nodes:
            return math.inf
        c = erlang_c(nodes, a)
        if q is None:
            wait = c * s / (nodes - a)
        else:
            wait = s / (nodes - a) * math.log(c / (1 - q)) if c > 1 - q else 0.0
        return s + wait + self.decode_step(1, isl, corr_d) / 2

    def size_prefill(self, rate: float, isl: float, max_nodes: int, corr_p: float = 1.0,
                     corr_d: float = 1.0, margin: float = 0.0) -> PrefillSizing:
        """The fewest nodes whose TTFT at the SLO's quantile is within (1 - ``margin``) x
        the bound."""
        s = self.prefill_seconds(isl, corr_p)
        a = rate * s
        for nodes in range(max(1, math.floor(a) + 1), max_nodes + 1):
            t = self.ttft(rate, isl, nodes, corr_p, corr_d, self.slo.attainment)
            if t <= (1 - margin) * self.slo.ttft_s:
                return PrefillSizing(nodes, s, a, t, True)
        t = self.ttft(rate, isl, max_nodes, corr_p, corr_d, self.slo.attainment)
        return PrefillSizing(max_nodes, s, a, t, False)

    # ---- decode --------------------------------------------------------------------------------
    def decode_step(self, batch: float, isl: float, corr_d: float = 1.0, osl: float = 0.0) -> float:
        """One decode step of ``batch`` requests whose contexts average ``isl + osl / 2``."""
        b = max(1, math.ceil(batch - 1e-9))
        return corr_d * self._decode_sim.step_seconds(b, [], round(b * (isl + osl / 2)))

    def max_batch(self, isl: float, osl: float, reserved: float = 0.0) -> int:
        """Requests one decode node can hold: its KV cache (full contexts, with headroom, less
        ``reserved`` tokens) and its step's token budget."""
        kv = int(max(0.0, self.kv_headroom * self.decode.kv_pool_tokens - reserved) // max(1.0, isl + osl))
        return max(1, min(kv, self.decode.max_num_batched_tokens))

    def reserved_tokens(self, rate: float, isl: float) -> float:
        """Prompt tokens the decode nodes hold for requests still being prefilled elsewhere
        (a decode node reserves a prompt's blocks when the request arrives): rate x the TTFT
        bound x isl, the most the SLO lets them wait."""
        return rate * self.slo.ttft_s * isl

    def decode_batch(self, rate: float, isl: float, osl: float, nodes: int, corr_d: float = 1.0) -> float:
        """Requests per decode node at ``rate`` (the fixed point of b = rate x osl x step(b) /
        nodes); inf when it grows past what a node holds."""
        cap = self.max_batch(isl, osl, self.reserved_tokens(rate, isl) / nodes)
        b = rate * osl * self.decode_step(1, isl, corr_d, osl) / nodes
        for _ in range(100):
            if b > cap:
                return math.inf
            nxt = rate * osl * self.decode_step(b, isl, corr_d, osl) / nodes
            if abs(nxt - b) < 1e-3 * max(1.0, b):
                return nxt
            b = nxt
        return b

    def decode_nodes_for(self, running: float, isl: float, osl: float, max_nodes: int, corr_d: float = 1.0,
                         margin: float = 0.0) -> int:
        """The fewest decode nodes that run ``running`` requests at once within (1 -
        ``margin``) x the ITL bound (a floor from what the decode nodes hold now)."""
        bound = (1 - margin) * self.itl_headroom * self.slo.itl_s
        cap = self.max_batch(isl, osl)
        for nodes in range(1, max_nodes + 1):
            b = running / nodes
            if b <= cap and self.decode_step(b, isl, corr_d, osl) <= bound:
                return nodes
        return max_nodes

    def size_decode(self, rate: float, isl: float, osl: float, max_nodes: int,
                    corr_d: float = 1.0, margin: float = 0.0) -> DecodeSizing:
        """The fewest nodes whose step at their batch is within (1 - ``margin``) x the
        ITL bound's headroom (feasible: some size within ``max_nodes`` is)."""
        bound = (1 - margin) * self.itl_headroom * self.slo.itl_s
        sizing = None
        for nodes in range(1, max_nodes + 1):
            b = self.decode_batch(rate, isl, osl, nodes, corr_d)
            if math.isinf(b):
                continue
            step = self.decode_step(b, isl, corr_d, osl)
            sizing = DecodeSizing(nodes, b, step, b * (isl + osl) / self.decode.kv_pool_tokens, step <= bound)
            if sizing.feasible:
                return sizing
        if sizing is None or sizing.nodes != max_nodes:
            b = rate * osl * self.decode_step(1, isl, corr_d, osl) / max_nodes
            sizing = DecodeSizing(max_nodes, b, math.inf, b * (isl + osl) / self.decode.kv_pool_tokens, False)
        return sizing
