"""One planning decision per interval: observation -> prediction -> correction -> targets
-> what to change, within bounds and cooldowns, written down as a ``PlanningDecision``.

    1. predict   input and output length of the next interval(s) (predictor.py); the
                 rate asked of the pools is the mean of the last ``rate_window``
                 observations (a few requests an interval: one interval's count is mostly
                 noise, and a forecast of it more so). The mix: the answers the decode
                 nodes are generating now (RUNNING_ANSWER_FACTOR x their mean length so
                 far) raise the output length when they outgrow the finished ones, so a
                 shift to longer answers moves decode before any of them ends
    2. correct   from the last ``corr_window`` measured intervals of each role together,
                 each weighted by its requests (a handful of requests a interval says
                 little alone; pooled, one odd interval moves little):
                 corr_p: the prefill stretch that makes the model's mean TTFT (at each
                 interval's rate, prompt length and prefill nodes) equal the observed mean
                 TTFT (bisection); corr_d: observed mean ITL / the model's mean step, the
                 step of each decode node at its own batch weighted by its requests (a
                 pool just grown holds the old requests on its old nodes: that unevenness
                 passes, it is not the profile's error). An interval is measured only
                 with >= min_samples requests and the role's pool settled (every node it
                 counts registered, no change during the interval: a backlog left by a
                 pool still growing is not the profile's error); clamped to [corr_min,
                 corr_max]
    3. size      perf.PoolModel at the predicted load with the corrections, and floors from
                 the work already on the nodes: decode at least what the requests it will
                 hold by the time nodes started now and at the next decision serve need
                 (``ahead`` + 1 intervals: those held now plus the arrivals the finishes
                 do not balance; a shift to longer answers piles requests up before any
                 ends), prefill at least what its queued prompt tokens need to start
                 within the TTFT bound (a burst's backlog outlives the burst's arrivals);
                 the floors hold in an interval with no new requests too. Two sizes per
                 pool, clamped to [min, max]: ``grow`` meets the bound, ``keep`` meets it
                 with the ``hysteresis`` margin ((1 - hysteresis) x the TTFT bound; x the
                 ITL headroom). The target is ``grow`` below it, ``keep`` above it and the
                 current size in between: the hysteresis band, where noise in the load
                 moves nothing
    4. change    up to the target (the whole predicted deficit at once) after ``up_after``
                 decisions in a row wanted more; at once when a floor needs it (the work
                 on the nodes is no forecast) or the last interval missed the role's bound
                 for more than the SLO allows and more than chance explains (the
                 one-sided 95% upper bound of its attainment, Wilson score over its
                 requests, under the SLO's: one slow request of five is not a miss);
                 cooldown_up_s after the role's last change. Down to the target (at most
                 ``down_step`` nodes) only after ``down_after`` decisions in a row wanted
                 fewer and cooldown_down_s after the role's last change. A pool of
                 data-parallel nodes (``PolicyConfig.prefill_dp`` / ``decode_dp`` ranks each)
                 counts ranks, as the node registry and the profiles do (each rank is a node of
                 the pool), and moves by whole DP nodes: its target is rounded up to one
                 (its bounds are whole nodes: config.py), its down step too

The ``PlanningDecision`` keeps everything it was based on (observed and predicted load, the
corrections, each pool's sizing and SLO margin, why it changed or held); service.py logs,
exports and serves it. Owns the rule; must not scrape or start anything.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from .observe import Observation, PoolState
from .perf import DecodeSizing, PoolModel, PrefillSizing
from .predictor import Ensemble

ROLES = ("prefill", "decode")
# A running request's answer so far, times this, is what the mix says about answer lengths:
# 2 would be the mean of equal answers halfway through, but long answers run longer and so
# are over-represented among the running ones (by 1 + their squared coefficient of
# variation), and 2 overstates a varied mix; the finished answers say the steady state.
RUNNING_ANSWER_FACTOR = 1.5


@dataclass(frozen=True, slots=True)
class Bounds:
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8

    def __post_init__(self):
        if not (0 <= self.min_prefill <= self.max_prefill and 1 <= self.min_decode <= self.max_decode):
            raise ValueError(f"planner bounds: need 0 <= min prefill <= max prefill and 1 <= min decode "
                             f"<= max decode, got {self}")

    def clamp(self, role: str, n: int) -> int:
        lo, hi = (self.min_prefill, self.max_prefill) if role == "prefill" else (self.min_decode, self.max_decode)
        return max(lo, min(hi, n))


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    bounds: Bounds = Bounds()
    cooldown_up_s: float = 30.0  # wall seconds after a role's change before it grows again
    cooldown_down_s: float = 120.0  # ... before it shrinks
    down_after: int = 2  # decisions in a row that want fewer nodes before one goes
    down_step: int = 4  # nodes one decision may remove from a role, at most
    up_after: int = 1  # decisions in a row that want more nodes before they start (SLO missed: at once)
    hysteresis: float = 0.2  # a pool shrinks only to a size predicted within (1 - this) x the bound
    min_samples: int = 5  # requests an interval needs to move a correction
    corr_min: float = 0.5
    corr_max: float = 3.0
    corr_window: int = 5  # the correction pools this many of the last measured intervals
    rate_window: int = 4  # observations the rate the pools are sized for averages
    prefill_dp: int = 1  # ranks of one prefill node: the pool starts and drains this many at once
    decode_dp: int = 1  # ... of one decode node

    def ranks(self, role: str) -> int:
        """Ranks of one node of ``role`` (its data-parallel size): the pool's unit of change."""
        return self.prefill_dp if role == "prefill" else self.decode_dp

    def __post_init__(self):
        b = self.bounds
        for role, lo, hi in (("prefill", b.min_prefill, b.max_prefill), ("decode", b.min_decode, b.max_decode)):
            k = self.ranks(role)
            if k < 1 or lo % k or hi % k or hi < k:
                raise ValueError(f"planner: the {role} bounds {lo}..{hi} must be whole nodes of {k} "
                                 f"data-parallel ranks (config.py rounds the flags)")
        if min(self.cooldown_up_s, self.cooldown_down_s) < 0 or min(self.down_after, self.down_step,
                                                                     self.up_after, self.rate_window) < 1:
            raise ValueError("planner: cooldowns must be >= 0; down_after, down_step, up_after and rate_window >= 1")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"planner: hysteresis must be in [0, 1), got {self.hysteresis}")
        if not 0 < self.corr_min <= 1 <= self.corr_max or self.corr_window < 1:
            raise ValueError("planner: need 0 < corr_min <= 1 <= corr_max and corr_window >= 1")


class Sizing(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One pool's size at the predicted load, as perf.py computed it."""
    nodes: int
    feasible: bool
    predicted_latency_s: float | None  # prefill: TTFT at the SLO's quantile; decode: the step (ITL)
    slo_margin: float | None  # (bound - predicted) / bound: > 0 inside the SLO
    load: float  # prefill: busy nodes (rate x service); decode: requests per node
    keep: int  # the fewest nodes that meet the bound with the hysteresis margin: more than this shrink


class PlanningDecision(msgspec.Struct, omit_defaults=True, kw_only=True):
    seq: int
    at: float  # unix time
    interval_s: float  # profile seconds the observation covers
    observed: dict[str, float | int | None]  # rate, isl, osl, TTFT/ITL mean and share within the SLO, ...
    pools: dict[str, dict[str, float | int]]  # role -> nodes, running, waiting, queued tokens, kv usage
    predicted: dict[str, float | None]  # rate, isl, osl the pools were sized for
    predictors: dict[str, str]  # series -> the predictor that answered
    correction: dict[str, float]  # role -> stretch of the profile's time
    sizing: dict[str, Sizing]  # role -> the model's size
    current: dict[str, int]  # role -> nodes serving or starting before the decision
    target: dict[str, int]  # role -> the bounded size
    change: dict[str, int]  # role -> nodes asked to start (> 0) or drain (< 0)
    reasons: list[str] = msgspec.field(default_factory=list)


@dataclass(slots=True)
class Policy:
    model: PoolModel
    config: PolicyConfig = field(default_factory=PolicyConfig)
    ahead: int = 1
    window: int = 6
    time_scale: float = 1.0  # profile seconds per wall second (observations are in profile time)
    corr: dict[str, float] = field(default_factory=lambda: {r: 1.0 for r in ROLES})
    series: dict[str, Ensemble] = field(default_factory=dict)  # rate / isl / osl -> predictor
    last_change: dict[str, float] = field(default_factory=lambda: {r: -math.inf for r in ROLES})
    wanted_fewer: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})
    wanted_more: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})
    last: dict[str, float] = field(default_factory=dict)  # series -> last observed value
    rates: deque[float] = field(default_factory=deque)  # the last observed rates
    measured: dict[str, deque[Measured]] = field(default_factory=lambda: {r: deque() for r in ROLES})
    decode_running: float | None = None  # the decode nodes' running requests at the last observation
    seq: int = 0

    def __post_init__(self):
        for name in ("rate", "isl", "osl"):
            self.series.setdefault(name, Ensemble(window=self.window, ahead=self.ahead))

    def decide(self, obs: Observation, current: dict[str, int], now: float | None = None) -> PlanningDecision:
        """The decision for ``obs`` with ``current`` nodes per role (serving or starting);
        ``now``: monotonic seconds (cooldowns)."""
        now = time.monotonic() if now is None else now
        self.seq += 1
        reasons: list[str] = []
        values = {"rate": obs.rate, "isl": obs.isl, "osl": obs.osl}
        for name, y in values.items():
            if y is not None:
                self.series[name].observe(y)
                self.last[name] = y
        predicted = {name: self.series[name].forecast() for name in values}
        self.rates.append(obs.rate)
        while len(self.rates) > self.config.rate_window:
            self.rates.popleft()
        rate = sum(self.rates) / len(self.rates)
        isl = predicted["isl"] or self.last.get("isl") or 1.0
        osl = predicted["osl"] or self.last.get("osl") or 1.0
        settled = {role: obs.pools[role].nodes == current[role]
                   and now - self.last_change[role] >= obs.interval_s / self.time_scale for role in ROLES}
        self._correct(obs, isl, osl, settled)

        c, b = self.config, self.config.bounds
        dpool = obs.pools["decode"]
        # the mix: a running request is on average halfway through its answer, so the answers
        # the decode nodes are generating now say how long they are before any of them ends
        osl_running = RUNNING_ANSWER_FACTOR * dpool.generated_tokens / dpool.running if dpool.running else 0.0
        if osl_running > osl:
            reasons.append(f"decode: the running requests' answers point to {osl_running:.0f} output tokens "
                           f"(the finished ones say {osl:.0f})")
            osl = osl_running
        # the requests the decode nodes will hold by the time the nodes started now serve and
        # the next decision's could (``ahead`` + 1 intervals): those held now plus the
        # arrivals the finishes do not balance (a shift to longer answers piles them up
        # before any of them ends; arrivals at the larger of this interval's rate and the
        # window's, as one interval's count is noisy)
        held = dpool.running + dpool.waiting
        finish_rate = obs.finished / obs.interval_s if obs.interval_s > 0 else 0.0
        held_next = held + max(0.0, max(obs.rate, rate) - finish_rate) * obs.interval_s * (self.ahead + 1)
        slo = self.model.slo
        # the prompt tokens already queued on the prefill nodes must start within the TTFT bound
        # too: a backlog left by a burst keeps its nodes even in an interval with no new requests
        pool = obs.pools["prefill"]
        queued, prompts = pool.queued_prefill_tokens, max(1, pool.running + pool.waiting)
        backlog = min(b.max_prefill, math.ceil(
            prompts * self.model.prefill_seconds(queued / prompts, self.corr["prefill"]) / slo.ttft_s)) if queued else 0

        def size(margin: float) -> tuple[PrefillSizing, DecodeSizing, dict[str, int]]:
            """Each pool's size at the predicted load within (1 - margin) x its bound, and
            what the work already on the nodes needs (floors)."""
            p = self.model.size_prefill(rate, isl, b.max_prefill, self.corr["prefill"], self.corr["decode"], margin)
            d = self.model.size_decode(rate, isl, osl, b.max_decode, self.corr["decode"], margin)
            floor = self.model.decode_nodes_for(held_next, isl, osl, b.max_decode, self.corr["decode"],
                                                margin) if held_next else 0
            return p, d, {"prefill": backlog, "decode": floor}

        p, d, floors = size(0.0)
        if floors["decode"] > d.nodes:
            reasons.append(f"decode: the {held} requests on the decode nodes ({held_next:.0f} when new nodes could serve) need "
                           f"{floors['decode']} nodes (the rate and output length say {d.nodes})")
        if backlog > (p.nodes if rate > 0 else 0):
            reasons.append(f"prefill: the {queued} prompt tokens queued on the prefill nodes need {backlog} "
                           f"nodes to start within the TTFT bound (the rate says {p.nodes if rate > 0 else 0})")
        pk, dk, floors_k = size(c.hysteresis)
        # grow to the size that meets the bound; shrink only to the one that meets it with margin
        def bounded(p: PrefillSizing, d: DecodeSizing, floors: dict[str, int]) -> dict[str, int]:
            sized = {"prefill": p.nodes, "decode": d.nodes} if rate > 0 else {"prefill": 0, "decode": 0}
            return {role: b.clamp(role, max(sized[role], floors[role])) for role in ROLES}
        lo, hi = bounded(p, d, floors), bounded(pk, dk, floors_k)
        sizing = {
            "prefill": Sizing(nodes=p.nodes, feasible=p.feasible, predicted_latency_s=_finite(p.ttft_q_s),
                              slo_margin=_margin(slo.ttft_s, p.ttft_q_s), load=round(p.offered, 4), keep=hi["prefill"]),
            "decode": Sizing(nodes=max(d.nodes, floors["decode"]), feasible=d.feasible,
                             predicted_latency_s=_finite(d.step_s), slo_margin=_margin(slo.itl_s, d.step_s),
                             load=round(d.batch, 3), keep=hi["decode"]),
        }
        for role, sz in sizing.items():
            if not sz.feasible:
                reasons.append(f"{role}: the SLO is out of reach within {sz.nodes} nodes at this load")
        target = {role: whole(lo[role] if current[role] < lo[role] else min(current[role], hi[role]), c.ranks(role))
                  for role in ROLES}  # a data-parallel pool moves by whole nodes (within bounds of whole nodes)
        # the work already on the nodes is no forecast: what it needs starts at once
        urgent = {role: b.clamp(role, floors[role]) > current[role] for role in ROLES}
        change = {}
        missed = {"prefill": obs.ttft_n >= c.min_samples and significantly_below(obs.ttft_ok, obs.ttft_n, slo.attainment),
                  "decode": obs.itl_n >= c.min_samples and significantly_below(obs.itl_ok, obs.itl_n, slo.attainment)}
        for role in ROLES:
            cur, want = current[role], target[role]
            since = now - self.last_change[role]
            if want > cur:
                self.wanted_fewer[role] = 0
                self.wanted_more[role] += 1
                if since < c.cooldown_up_s:
                    change[role] = 0
                    reasons.append(f"{role}: wants {want}, cooling down ({since:.0f} of {c.cooldown_up_s:g} s)")
                elif self.wanted_more[role] >= c.up_after or missed[role] or urgent[role]:
                    change[role] = want - cur
                    reasons.append(f"{role}: {cur} -> {want} nodes"
                                   + (" (the last interval missed the SLO)" if missed[role] else "")
                                   + (" (for the work on the nodes now)" if urgent[role] and not missed[role] else ""))
                else:
                    change[role] = 0
                    reasons.append(f"{role}: wants {want}, holding {cur} ({self.wanted_more[role]}/{c.up_after} "
                                   "decisions)")
            elif want < cur:
                self.wanted_more[role] = 0
                self.wanted_fewer[role] += 1
                if self.wanted_fewer[role] >= c.down_after and since >= c.cooldown_down_s:
                    change[role] = -min(whole(c.down_step, c.ranks(role)), cur - want)
                    reasons.append(f"{role}: {cur} -> {cur + change[role]} nodes (target {want}), draining")
                else:
                    change[role] = 0
                    reasons.append(f"{role}: wants {want}, holding {cur} ({self.wanted_fewer[role]}/{c.down_after} "
                                   f"decisions, {since:.0f} of {c.cooldown_down_s:g} s since the last change)")
            else:
                self.wanted_fewer[role] = self.wanted_more[role] = 0
                change[role] = 0
            if change[role]:
                self.last_change[role] = now
                self.wanted_fewer[role] = self.wanted_more[role] = 0
        return PlanningDecision(
            seq=self.seq, at=time.time(), interval_s=round(obs.interval_s, 3),
            observed={"rate": round(obs.rate, 4), "isl": _r(obs.isl), "osl": _r(obs.osl),
                      "ttft_mean_s": _r(obs.ttft_mean), "ttft_within_slo": _r(obs.ttft_ok),
                      "itl_mean_s": _r(obs.itl_mean), "itl_within_slo": _r(obs.itl_ok),
                      "finished": obs.finished, "failures": obs.failures, "in_flight": obs.in_flight},
            pools={role: {"nodes": s.nodes, "running": s.running, "waiting": s.waiting,
                          "queued_prefill_tokens": s.queued_prefill_tokens, "kv_usage": round(s.kv_usage, 3)}
                   for role, s in obs.pools.items()},
            predicted={"rate": round(rate, 4), "isl": round(isl, 1), "osl": round(osl, 1)},
            predictors={name: e.chosen().name for name, e in self.series.items()},
            correction={r: round(v, 3) for r, v in self.corr.items()}, sizing=sizing,
            current=dict(current), target=target, change=change, reasons=reasons)

    def _correct(self, obs: Observation, isl: float, osl: float, settled: dict[str, bool]) -> None:
        c = self.config
        pools = obs.pools
        nodes = pools["prefill"].nodes
        corr_d = self.corr["decode"]
        # (an overloaded pool per the model, a >= P: its queue grows without bound, so no
        # stretch of the service explains one interval's TTFT; the size follows from the rate)
        if obs.ttft_mean is not None and obs.finished >= c.min_samples and nodes and settled["prefill"] \
                and not math.isinf(self.model.ttft(obs.rate, obs.isl or isl, nodes, self.corr["prefill"], corr_d)):
            self._measured("prefill", Measured(obs.finished, obs.ttft_mean, obs.rate, obs.isl or isl, nodes))
            self.corr["prefill"] = self._prefill_correction()
        running = pools["decode"].running
        before, self.decode_running = self.decode_running, running
        if obs.itl_mean is not None and obs.finished >= c.min_samples and pools["decode"].nodes and settled["decode"]:
            batches = interval_batches(pools["decode"], before)
            step = sum(b * self.model.decode_step(b, obs.isl or isl, 1.0, obs.osl or osl) for b in batches) / sum(batches)
            self._measured("decode", Measured(obs.finished, obs.itl_mean, model_s=step))
            window = self.measured["decode"]
            k = sum(m.n * m.observed_s for m in window) / sum(m.n * m.model_s for m in window)
            self.corr["decode"] = min(c.corr_max, max(c.corr_min, k))

    def _prefill_correction(self) -> float:
        """The stretch k in [corr_min, corr_max] whose model mean TTFT over the measured
        intervals (weighted by requests) equals the observed one (bisection: the model's
        TTFT grows with k; inf past a pool's capacity counts as too slow)."""
        c, window = self.config, self.measured["prefill"]
        total = sum(m.n for m in window)
        observed = sum(m.n * m.observed_s for m in window) / total

        def model(k: float) -> float:
            return sum(m.n * self.model.ttft(m.rate, m.isl, m.nodes, k, self.corr["decode"]) for m in window) / total
        lo, hi = c.corr_min, c.corr_max
        if model(hi) <= observed:
            return hi
        if model(lo) >= observed:
            return lo
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if model(mid) < observed else (lo, mid)
        return (lo + hi) / 2

    def _measured(self, role: str, m: Measured) -> None:
        window = self.measured[role]
        window.append(m)
        while len(window) > self.config.corr_window:
            window.popleft()

    def errors(self) -> dict[str, dict]:
        """series -> predictor -> its error summary (predictor.py)."""
        return {name: e.errors() for name, e in self.series.items()}


class Measured(NamedTuple):
    """One interval a correction rests on: its requests and observed mean latency, and what
    the model needs to predict it (prefill: rate, prompt length, nodes; decode: the model's
    mean step at corr 1)."""
    n: int
    observed_s: float
    rate: float = 0.0
    isl: float = 0.0
    nodes: int = 0
    model_s: float = 0.0


def interval_batches(pool: PoolState, running_before: float | None) -> list[float]:
    """The batch of each decode node running requests over the interval: its share of the
    requests running now, scaled to the mean of the pool's running requests at the
    interval's two ends (at least one request; evenly over the pool when nobody runs
    anything now)."""
    mean_total = (pool.running + (pool.running if running_before is None else running_before)) / 2
    by_node = pool.running_by_node if pool.running and len(pool.running_by_node) == pool.nodes else ()
    if not by_node:
        return [max(1.0, mean_total / pool.nodes)] * pool.nodes
    return [max(1.0, r * mean_total / pool.running) for r in by_node if r]


def whole(n: int, ranks: int) -> int:
    """``n`` ranks rounded up to whole nodes of ``ranks`` data-parallel ranks."""
    return -(-n // ranks) * ranks


def significantly_below(share: float | None, n: int, target: float, z: float = 1.645) -> bool:
    """Whether ``share`` of ``n`` requests within a bound says the attainment is under
    ``target`` beyond chance: the Wilson score interval's upper end (one-sided, z = 1.645:
    95%) is under it."""
    if share is None or n <= 0:
        return False
    z2 = z * z
    upper = (share + z2 / (2 * n) + z * math.sqrt(share * (1 - share) / n + z2 / (4 * n * n))) / (1 + z2 / n)
    return upper < target


def _r(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def _finite(v: float) -> float | None:
    return None if math.isinf(v) else round(v, 4)


def _margin(bound: float, predicted: float) -> float | None:
    return None if math.isinf(predicted) else round((bound - predicted) / bound, 4)
