"""Load predictors: the next interval's value of one observed series (request rate, mean
input length, mean output length), ``ahead`` intervals out, each with its error kept.

    moving_average   the mean of the last ``window`` observations: steady, lags a ramp
    holt             Holt's linear trend (double exponential smoothing):
                        level_t = alpha x y_t + (1 - alpha) x (level_{t-1} + trend_{t-1})
                        trend_t = beta x (level_t - level_{t-1}) + (1 - beta) x trend_{t-1}
                        forecast(h) = level_t + h x trend_t        (never below 0)
                     follows a ramp, overshoots a step for a few intervals
    Ensemble         runs both and answers with the one whose recent absolute error
                     (mean over ``error_window`` scored forecasts) is smaller; every
                     forecast is scored when its interval's observation arrives

Errors reported (``errors()``): per predictor, the mean absolute percentage error
(MAPE, over observations > 0) and the mean signed error (bias), over all scored
forecasts and the recent window. Owns the arithmetic only; must not read metrics.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


class Predictor(Protocol):
    name: str

    def observe(self, y: float) -> None: ...
    def forecast(self, ahead: int = 1) -> float | None: ...  # None: no observation yet


@dataclass(slots=True)
class MovingAverage:
    window: int = 6
    name: str = "moving_average"
    _ys: deque[float] = field(default_factory=deque)

    def observe(self, y: float) -> None:
        self._ys.append(y)
        while len(self._ys) > self.window:
            self._ys.popleft()

    def forecast(self, ahead: int = 1) -> float | None:
        return sum(self._ys) / len(self._ys) if self._ys else None


@dataclass(slots=True)
class Holt:
    alpha: float = 0.5
    beta: float = 0.3
    name: str = "holt"
    level: float | None = None
    trend: float = 0.0

    def observe(self, y: float) -> None:
        if self.level is None:
            self.level = y
            return
        prev = self.level
        self.level = self.alpha * y + (1 - self.alpha) * (prev + self.trend)
        self.trend = self.beta * (self.level - prev) + (1 - self.beta) * self.trend

    def forecast(self, ahead: int = 1) -> float | None:
        return None if self.level is None else max(0.0, self.level + ahead * self.trend)


@dataclass(slots=True)
class Score:
    """Forecast errors of one predictor: (forecast - observed) per scored forecast."""
    errors: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    pct: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))  # |error| / observed, observed > 0

    def add(self, forecast: float, observed: float) -> None:
        self.errors.append(forecast - observed)
        if observed > 0:
            self.pct.append(abs(forecast - observed) / observed)

    def summary(self, recent: int) -> dict[str, float | int | None]:
        def mean(xs) -> float | None:
            xs = list(xs)
            return round(sum(xs) / len(xs), 4) if xs else None
        tail = list(self.errors)[-recent:]
        return {"scored": len(self.errors), "mape": mean(self.pct), "bias": mean(self.errors),
                "recent_mae": mean(abs(e) for e in tail), "recent_mape": mean(list(self.pct)[-recent:])}


class Ensemble:
    """A moving average and Holt's trend side by side; ``forecast`` answers with the one
    of smaller recent absolute error (the moving average until both are scored)."""

    def __init__(self, window: int = 6, alpha: float = 0.5, beta: float = 0.3, ahead: int = 1,
                 error_window: int = 6):
        if window < 1 or ahead < 1 or error_window < 1:
            raise ValueError("predictor: window, ahead and error_window must be >= 1")
        if not (0 < alpha <= 1 and 0 <= beta <= 1):
            raise ValueError(f"predictor: alpha must be in (0, 1] and beta in [0, 1], got {alpha}, {beta}")
        self.members: list[Predictor] = [MovingAverage(window), Holt(alpha, beta)]
        self.ahead, self.error_window = ahead, error_window
        self.scores = {p.name: Score() for p in self.members}
        # forecasts waiting for their observation: (observations until due, name -> forecast)
        self._pending: deque[tuple[int, dict[str, float]]] = deque()
        self.observations = 0

    def observe(self, y: float) -> None:
        """The next interval's observation: scores the forecasts made for it, then updates."""
        self.observations += 1
        due = [(n - 1, f) for n, f in self._pending]
        self._pending = deque(d for d in due if d[0] > 0)
        for n, forecasts in due:
            if n == 0:
                for name, f in forecasts.items():
                    self.scores[name].add(f, y)
        made: dict[str, float] = {}
        for p in self.members:
            p.observe(y)
            forecast = p.forecast(self.ahead)
            if forecast is not None:
                made[p.name] = forecast
        if made:
            self._pending.append((self.ahead, made))

    def chosen(self) -> Predictor:
        recent = {p.name: self.scores[p.name].summary(self.error_window)["recent_mae"] for p in self.members}
        if any(v is None for v in recent.values()):
            return self.members[0]
        return min(self.members, key=lambda p: (recent[p.name], p.name != "moving_average"))

    def forecast(self) -> float | None:
        return self.chosen().forecast(self.ahead)

    def errors(self) -> dict[str, dict]:
        return {name: s.summary(self.error_window) for name, s in self.scores.items()}
