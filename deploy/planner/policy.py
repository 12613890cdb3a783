"""One planning decision per interval: observation -> prediction -> correction -> targets
-> what to change, within bounds and cooldowns, written down as a ``Decision``.

    1. predict   rate, input and output length of the next interval(s) (predictor.py);
                 the rate asked of the pools is max(predicted, observed): a forecast may
                 lag a step up, never hide it
    2. correct   corr_p: the prefill stretch that makes the model's mean TTFT at the
                 observed rate and prefill nodes equal the observed mean TTFT (bisection);
                 corr_d: observed mean ITL / the model's step at the observed batch per
                 decode node. Each only from an interval with >= min_samples requests
                 in which the role's pool was settled (every node it counts registered, no
                 change during the interval: a backlog left by a pool still growing is not
                 the profile's error), clamped to [corr_min, corr_max], smoothed (EMA,
                 weight corr_weight)
    3. size      perf.PoolModel at the predicted load with the corrections, clamped to
                 [min, max] per role
    4. change    up at once to the target (cooldown_up_s after the role's last change);
                 down by at most down_step nodes, only after ``down_after`` decisions in a
                 row wanted fewer and cooldown_down_s after the role's last change

The ``Decision`` keeps everything it was based on (observed and predicted load, the
corrections, each pool's sizing and SLO margin, why it changed or held); service.py logs,
exports and serves it. Owns the rule; must not scrape or start anything.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import msgspec

from .observe import Observation
from .perf import PoolModel
from .predictor import Ensemble

ROLES = ("prefill", "decode")


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
    down_step: int = 1  # nodes one decision may remove from a role
    min_samples: int = 5  # requests an interval needs to move a correction
    corr_min: float = 0.5
    corr_max: float = 3.0
    corr_weight: float = 0.5  # EMA weight of a new correction

    def __post_init__(self):
        if min(self.cooldown_up_s, self.cooldown_down_s) < 0 or self.down_after < 1 or self.down_step < 1:
            raise ValueError("planner: cooldowns must be >= 0, down_after and down_step >= 1")
        if not 0 < self.corr_min <= 1 <= self.corr_max or not 0 < self.corr_weight <= 1:
            raise ValueError("planner: need 0 < corr_min <= 1 <= corr_max and 0 < corr_weight <= 1")


class Sizing(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One pool's size at the predicted load, as perf.py computed it."""
    nodes: int
    feasible: bool
    predicted_latency_s: float | None  # prefill: TTFT at the SLO's quantile; decode: the step (ITL)
    slo_margin: float | None  # (bound - predicted) / bound: > 0 inside the SLO
    load: float  # prefill: busy nodes (rate x service); decode: requests per node


class Decision(msgspec.Struct, omit_defaults=True, kw_only=True):
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
    last: dict[str, float] = field(default_factory=dict)  # series -> last observed value
    seq: int = 0

    def __post_init__(self):
        for name in ("rate", "isl", "osl"):
            self.series.setdefault(name, Ensemble(window=self.window, ahead=self.ahead))

    def decide(self, obs: Observation, current: dict[str, int], now: float | None = None) -> Decision:
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
        rate = max(predicted["rate"] or 0.0, obs.rate)
        isl = predicted["isl"] or self.last.get("isl") or 1.0
        osl = predicted["osl"] or self.last.get("osl") or 1.0
        settled = {role: obs.pools[role].nodes == current[role]
                   and now - self.last_change[role] >= obs.interval_s / self.time_scale for role in ROLES}
        self._correct(obs, isl, osl, settled)

        c, b = self.config, self.config.bounds
        p = self.model.size_prefill(rate, isl, b.max_prefill, self.corr["prefill"], self.corr["decode"])
        d = self.model.size_decode(rate, isl, osl, b.max_decode, self.corr["decode"])
        slo = self.model.slo
        sizing = {
            "prefill": Sizing(nodes=p.nodes, feasible=p.feasible, predicted_latency_s=_finite(p.ttft_q_s),
                              slo_margin=_margin(slo.ttft_s, p.ttft_q_s), load=round(p.offered, 4)),
            "decode": Sizing(nodes=d.nodes, feasible=d.feasible, predicted_latency_s=_finite(d.step_s),
                             slo_margin=_margin(slo.itl_s, d.step_s), load=round(d.batch, 3)),
        }
        for role, s in sizing.items():
            if not s.feasible:
                reasons.append(f"{role}: the SLO is out of reach within {s.nodes} nodes at this load")
        target = {role: b.clamp(role, sizing[role].nodes if rate > 0 else 0) for role in ROLES}
        change = {}
        for role in ROLES:
            cur, want = current[role], target[role]
            since = now - self.last_change[role]
            if want > cur:
                self.wanted_fewer[role] = 0
                if since >= c.cooldown_up_s:
                    change[role] = want - cur
                    reasons.append(f"{role}: {cur} -> {want} nodes")
                else:
                    change[role] = 0
                    reasons.append(f"{role}: wants {want}, cooling down ({since:.0f} of {c.cooldown_up_s:g} s)")
            elif want < cur:
                self.wanted_fewer[role] += 1
                if self.wanted_fewer[role] >= c.down_after and since >= c.cooldown_down_s:
                    change[role] = -min(c.down_step, cur - want)
                    reasons.append(f"{role}: {cur} -> {cur + change[role]} nodes (target {want}), draining")
                else:
                    change[role] = 0
                    reasons.append(f"{role}: wants {want}, holding {cur} ({self.wanted_fewer[role]}/{c.down_after} "
                                   f"decisions, {since:.0f} of {c.cooldown_down_s:g} s since the last change)")
            else:
                self.wanted_fewer[role] = 0
                change[role] = 0
            if change[role]:
                self.last_change[role] = now
                self.wanted_fewer[role] = 0
        return Decision(
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
        f = lambda k: self.model.ttft(obs.rate, obs.isl or isl, nodes, k, self.corr["decode"])  # noqa: E731
        # (an overloaded pool per the model, a >= P: its queue grows without bound, so no
        # stretch of the service explains one interval's TTFT; the size follows from the rate)
        if obs.ttft_mean is not None and obs.finished >= c.min_samples and nodes and settled["prefill"] \
                and not math.isinf(f(self.corr["prefill"])):
            lo, hi = c.corr_min, c.corr_max
            if f(hi) <= obs.ttft_mean:
                k = hi
            elif f(lo) >= obs.ttft_mean:
                k = lo
            else:
                for _ in range(40):
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if f(mid) < obs.ttft_mean else (lo, mid)
                k = (lo + hi) / 2
            self._smooth("prefill", k)
        if obs.itl_mean is not None and obs.finished >= c.min_samples and pools["decode"].nodes and settled["decode"]:
            batch = max(1.0, pools["decode"].running / pools["decode"].nodes)
            step = self.model.decode_step(batch, obs.isl or isl, 1.0, obs.osl or osl)
            self._smooth("decode", min(c.corr_max, max(c.corr_min, obs.itl_mean / step)))

    def _smooth(self, role: str, k: float) -> None:
        w = self.config.corr_weight
        self.corr[role] = (1 - w) * self.corr[role] + w * k

    def errors(self) -> dict[str, dict]:
        """series -> predictor -> its error summary (predictor.py)."""
        return {name: e.errors() for name, e in self.series.items()}


def _r(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def _finite(v: float) -> float | None:
    return None if math.isinf(v) else round(v, 4)


def _margin(bound: float, predicted: float) -> float | None:
    return None if math.isinf(predicted) else round((bound - predicted) / bound, 4)
