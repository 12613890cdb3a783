"""An event-driven model of a prefill/decode fleet: how ``splitserve plan`` tries a
configuration in milliseconds instead of replaying it on simulated nodes for minutes.

It runs the schedulers of engine/scheduler.py in miniature over the same step-time model
the simulated nodes sleep (``SimProfile.sim_config().step_seconds``: the roofline of a
GPU profile, or this CPU's fit)::

    router         each request, at its arrival, to the prefill node with the fewest
                   prompt tokens assigned and not computed, and the decode node with the
                   fewest requests assigned and not finished (the load terms of
                   router/routing/cache_aware.py without the prefix term: no cache hits modelled)
    prefill node   steps of chunked prefill: running prompts first, then waiting ones
                   FIFO, each at most prefill_chunk_size tokens, max_num_batched_tokens
                   and max_num_seqs a step; a prompt's last chunk ends its prefill
    decode node    holds the prompt's KV from the request's arrival (a decode node reserves
                   the blocks before asking for the prefill); the prompt joins the batch
                   at the first step boundary after its prefill ended (the first token
                   leaves then, as AddPrefilled runs between steps), if the node's KV cache
                   also holds its output (else it waits, FIFO); then one token a step until
                   its output length

    TTFT = first token - arrival;   ITL (a request's) = (finish - first token) / (osl - 1)

Steps are not taken one by one: while nobody joins or leaves a decode batch, its steps
differ only by the context growing one token per request, so a run of steps is summed in
closed form (the roofline is a max of two lines in the context; the CPU fit ignores it).
Not modelled: prefix-cache hits, KV transfer time, a full decode pool's fallback to
local prefill, preemption. Must not talk to a cluster.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from ....common.config import SimConfig
from ..sim_profiles import SimDeployment, SimProfile


class Req(NamedTuple):
    arrival: float  # seconds
    isl: int
    osl: int


@dataclass(slots=True)
class Track:
    """One request's times (seconds; nan until reached)."""
    prefill_done: float = math.nan
    first: float = math.nan
    finish: float = math.nan


class StepSum:
    """Seconds of ``n`` decode steps of batch ``b`` whose contexts sum to ``c0``, ``c0 + b``,
    ... (``total``), for one profile."""

    def __init__(self, profile: SimProfile):
        self.sim = profile.sim_config()
        self.r = profile.roofline

    def one(self, b: int, ctx: float) -> float:
        return self.sim.step_seconds(b, [], round(ctx))

    def total(self, b: int, c0: float, n: int) -> float:
        if n <= 0:
            return 0.0
        r = self.r
        if r is None:  # the CPU fit: no context term in a decode step
            return n * self.one(b, c0)
        # step(c) = max(p0 + p1 c, m0 + m1 c) + overhead, c = c0 + i b for i < n
        p0, p1 = r.flops_per_token * b / r.flops_per_s, r.attn_flops / r.flops_per_s
        m0, m1 = r.step_weight_bytes(b) / r.bytes_per_s, r.kv_bytes_per_token / r.bytes_per_s
        fixed = n * (r.step_overhead_s + r.all_to_all_seconds(b))  # a MoE's all-to-all depends on b alone

        def lin(a: float, s: float, i0: int, i1: int) -> float:  # sum of a + s (c0 + i b), i0 <= i < i1
            k = i1 - i0
            return k * (a + s * c0) + s * b * (i0 + i1 - 1) * k / 2 if k > 0 else 0.0

        d0, d1 = p0 - m0 + (p1 - m1) * c0, (p1 - m1) * b  # compute minus memory at step i: d0 + d1 i
        if d1 == 0:
            split = n if d0 >= 0 else 0  # steps [0, split) compute-bound
            return lin(p0, p1, 0, split) + lin(m0, m1, split, n) + fixed
        cross = min(n, max(0, math.ceil(-d0 / d1)))  # first i where the sign of d0 + d1 i has turned
        if d1 > 0:  # memory-bound first, then compute-bound
            return lin(m0, m1, 0, cross) + lin(p0, p1, cross, n) + fixed
        return lin(p0, p1, 0, cross) + lin(m0, m1, cross, n) + fixed


@dataclass(slots=True)
class PrefillSim:
    profile: SimProfile
    tracks: list[Track]
    isls: list[int]  # request -> prompt tokens
    clock: float = 0.0  # when the next step may start
    waiting: deque[list[int]] = field(default_factory=deque)  # [request, tokens left]
    running: list[list[int]] = field(default_factory=list)
    assigned: int = 0  # prompt tokens not yet computed (the router's load figure)
    busy_s: float = 0.0
    sim: SimConfig = field(init=False, repr=False)

    def __post_init__(self):
        self.sim = self.profile.sim_config()

    def add(self, i: int, isl: int, t: float) -> None:
        if not self.waiting and not self.running:
            self.clock = max(self.clock, t)
        self.waiting.append([i, isl])
        self.assigned += isl

    def advance(self, until: float, done: list[tuple[float, int]]) -> None:
        """Run the steps that start before ``until``; prompts finished -> ``done`` (time, i)."""
        p = self.profile
        while (self.waiting or self.running) and self.clock < until:
            budget, stepped = p.max_num_batched_tokens, []
            for item in self.running:
                if budget <= 0:
                    break
                n = min(item[1], budget, p.prefill_chunk_size)
                stepped.append((item, n))
                budget -= n
            while self.waiting and budget > 0 and len(self.running) < p.max_num_seqs:
                item = self.waiting.popleft()
                self.running.append(item)
                n = min(item[1], budget, p.prefill_chunk_size)
                stepped.append((item, n))
                budget -= n
            dt = self.sim.step_seconds(0, [(n, self.isls[item[0]] - item[1]) for item, n in stepped])
            self.clock += dt
            self.busy_s += dt
            for item, n in stepped:
                item[1] -= n
                self.assigned -= n
                if item[1] == 0:
                    self.running.remove(item)
                    self.tracks[item[0]].prefill_done = self.clock
                    done.append((self.clock, item[0]))


@dataclass(slots=True)
class DecodeSim:
    profile: SimProfile
    steps: StepSum
    tracks: list[Track]
    reqs: list[Req]
    clock: float = 0.0  # end of the last step (the next step's start when busy)
    step_no: int = 0
    ctx: float = 0.0  # context tokens of the running requests, summed
    kv_used: int = 0  # whole contexts of the running requests and the prompts reserved
    ends: list[tuple[int, int]] = field(default_factory=list)  # heap (step it finishes at, request)
    joins: list[tuple[float, int]] = field(default_factory=list)  # heap (prefill done, request)
    kv_wait: deque[int] = field(default_factory=deque)  # ready, waiting for KV room
    assigned: int = 0  # requests assigned, not finished (the router's load figure)
    busy_s: float = 0.0

    def reserve(self, isl: int) -> None:
        self.kv_used += isl

    def generated(self) -> int:
        """Output tokens the running requests have produced so far."""
        return sum(self.step_no - end + self.reqs[i].osl for end, i in self.ends)

    def join(self, t: float, i: int) -> None:
        heapq.heappush(self.joins, (t, i))

    def _admit(self) -> None:
        """Requests ready at ``clock`` join the batch: their first token leaves now. One
        whose whole context does not fit beside the running ones waits (FIFO)."""
        while self.joins and self.joins[0][0] <= self.clock:
            self.kv_wait.append(heapq.heappop(self.joins)[1])
        pool = self.profile.kv_pool_tokens
        while self.kv_wait:
            i = self.kv_wait[0]
            r = self.reqs[i]
            if self.ends and self.kv_used + r.osl > pool:
                break
            self.kv_wait.popleft()
            self.tracks[i].first = self.clock
            if r.osl <= 1:
                self.kv_used -= r.isl
                self._finish(i)
                continue
            self.kv_used += r.osl
            self.ctx += r.isl + 1
            heapq.heappush(self.ends, (self.step_no + r.osl - 1, i))

    def _finish(self, i: int) -> None:
        self.tracks[i].finish = self.clock
        self.assigned -= 1

    def advance(self, until: float) -> None:
        """Run every step that starts before ``until``."""
        while True:
            self._admit()
            if not self.ends:  # idle: the next request to arrive starts at once
                if self.joins and self.joins[0][0] < until:
                    self.clock = max(self.clock, self.joins[0][0])
                    continue
                return
            if self.clock >= until:
                return
            b = len(self.ends)
            limit = min(until, self.joins[0][0] if self.joins else math.inf) - self.clock  # > 0 here
            k = self.ends[0][0] - self.step_no  # steps until the first of them finishes (>= 1)
            n = k if self.steps.total(b, self.ctx, k - 1) < limit else self._fit(b, limit, k)
            dt = self.steps.total(b, self.ctx, n)
            self.clock += dt
            self.busy_s += dt
            self.step_no += n
            self.ctx += n * b
            while self.ends and self.ends[0][0] <= self.step_no:
                _, i = heapq.heappop(self.ends)
                r = self.reqs[i]
                self.ctx -= r.isl + r.osl
                self.kv_used -= r.isl + r.osl
                self._finish(i)

    def _fit(self, b: int, limit: float, k: int) -> int:
        """How many of the next ``k`` steps start before ``limit`` seconds from now (>= 1:
        the first starts now)."""
        lo, hi = 0, k - 1  # total(lo) < limit holds for lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.steps.total(b, self.ctx, mid) < limit:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1


class FleetResult(NamedTuple):
    ttft: list[float]  # per request, seconds (nan: never served)
    itl: list[float]  # per request: mean inter-token latency (nan for one-token answers)
    prefill_busy: list[float]  # seconds each prefill node computed
    decode_busy: list[float]
    span_s: float  # first arrival to last finish


def simulate(reqs: list[Req], deployment: SimDeployment, prefill_nodes: int, decode_nodes: int) -> FleetResult:
    """Every request of ``reqs`` (sorted by arrival) through ``prefill_nodes`` +
    ``decode_nodes`` nodes of ``deployment``."""
    assert prefill_nodes >= 1 and decode_nodes >= 1
    tracks = [Track() for _ in reqs]
    isls = [r.isl for r in reqs]
    prefill = [PrefillSim(deployment.prefill, tracks, isls) for _ in range(prefill_nodes)]
    steps = StepSum(deployment.decode)
    decode = [DecodeSim(deployment.decode, steps, tracks, reqs) for _ in range(decode_nodes)]
    owner = [0] * len(reqs)  # request -> its decode node
    done: list[tuple[float, int]] = []

    def hand_over() -> None:
        for t, i in done:
            decode[owner[i]].join(t, i)
        done.clear()

    for i, r in enumerate(reqs):
        for p in prefill:
            p.advance(r.arrival, done)
        hand_over()
        for d in decode:
            d.advance(r.arrival)
        pi = min(range(prefill_nodes), key=lambda k: (prefill[k].assigned, (k - i) % prefill_nodes))
        di = min(range(decode_nodes), key=lambda k: (decode[k].assigned, (k - i) % decode_nodes))
        owner[i] = di
        decode[di].assigned += 1
        decode[di].reserve(r.isl)
        prefill[pi].add(i, r.isl, r.arrival)
    for p in prefill:
        p.advance(math.inf, done)
    hand_over()
    for d in decode:
        d.advance(math.inf)
    ttft = [t.first - r.arrival for t, r in zip(tracks, reqs)]
    itl = [(t.finish - t.first) / (r.osl - 1) if r.osl > 1 else math.nan for t, r in zip(tracks, reqs)]
    ends = [t.finish for t in tracks if not math.isnan(t.finish)]
    span = (max(ends) if ends else 0.0) - (reqs[0].arrival if reqs else 0.0)
    return FleetResult(ttft, itl, [p.busy_s for p in prefill], [d.busy_s for d in decode], span)
