"""Prometheus collectors whose every series carries the served model's ``model_name``
(and, on nodes, the node's ``role``): `ModelMetrics` builds them in one collector registry and
hands back objects with those labels already bound, so callers keep writing
``m.ttft.observe(s)`` or ``m.failures.labels(reason="x").inc()``.

Owns label binding only; the names are in metric_names.py, the collectors in
router/metrics.py and node/metrics.py. No module globals: one collector registry per process part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

M = TypeVar("M", Counter, Gauge, Histogram)


class BoundLabels(Generic[M]):
    """A labelled collector with its constant labels (model_name, ...) filled in:
    ``labels(...)`` takes only the remaining ones, by position or by name."""

    __slots__ = ("_metric", "_const")

    def __init__(self, metric: M, const: dict[str, str]):
        self._metric: M = metric
        self._const = const  # label name -> value, the leading labels of the collector

    def labels(self, *values: str, **named: str) -> M:
        if values:
            return self._metric.labels(*self._const.values(), *values)
        return self._metric.labels(**self._const, **named)


class ModelMetrics:
    """One collector registry; every collector gets the labels ``const`` (e.g. model_name) first.
    Without further ``labels`` a collector comes back as its one bound series; with
    them, as a BoundLabels that takes just those."""

    def __init__(self, const: dict[str, str]):
        self.collector_registry = CollectorRegistry()
        self.const = dict(const)

    def _bind(self, metric: M, labels: Sequence[str]) -> M | BoundLabels[M]:
        return BoundLabels(metric, self.const) if labels else metric.labels(**self.const)

    @overload
    def counter(self, name: str, doc: str) -> Counter: ...
    @overload
    def counter(self, name: str, doc: str, labels: Sequence[str]) -> BoundLabels[Counter]: ...

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter | BoundLabels[Counter]:
        return self._bind(Counter(name, doc, [*self.const, *labels], registry=self.collector_registry), labels)

    @overload
    def gauge(self, name: str, doc: str) -> Gauge: ...
    @overload
    def gauge(self, name: str, doc: str, labels: Sequence[str]) -> BoundLabels[Gauge]: ...

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge | BoundLabels[Gauge]:
        return self._bind(Gauge(name, doc, [*self.const, *labels], registry=self.collector_registry), labels)

    @overload
    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram: ...
    @overload
    def histogram(self, name: str, doc: str, buckets: Sequence[float],
                  labels: Sequence[str]) -> BoundLabels[Histogram]: ...

    def histogram(self, name: str, doc: str, buckets: Sequence[float],
                  labels: Sequence[str] = ()) -> Histogram | BoundLabels[Histogram]:
        return self._bind(Histogram(name, doc, [*self.const, *labels], buckets=buckets,
                                    registry=self.collector_registry), labels)

    def render(self) -> tuple[bytes, str]:
        """(exposition text, its content type)."""
        return generate_latest(self.collector_registry), CONTENT_TYPE_LATEST
