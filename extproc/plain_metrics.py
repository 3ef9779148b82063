"""Metrics touched on every request, kept as plain numbers and exposed by a collector
exactly as prometheus-client exposes its own (the same families, samples and creation
times): its ``Counter.inc`` and ``Histogram.observe`` check the metric, take locks and
walk the buckets in Python, about a microsecond each; here one lock and a ``bisect``.
``tests/test_plain_metrics.py`` holds the two expositions equal.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

Child = TypeVar("Child")


def use_created() -> bool:
    """Whether prometheus-client writes ``_created`` samples (it can be told not to:
    ``PROMETHEUS_DISABLE_CREATED_SERIES``; read from its module, True if it moves)."""
    return bool(getattr(prometheus_metrics, "_use_created", True))


class _LabelSets(Collector, Generic[Child]):
    """A metric's children, one per label set (``labelnames``), sharing the metric's one
    lock; an unlabelled metric has its one child at once, as prometheus-client's. A
    subclass says how a child is made (``_new_child``) and sets what that needs first."""

    def __init__(
        self,
        name: str,
        documentation: str,
        registry: CollectorRegistry,
        labelnames: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], Child] = {}
        if not labelnames:
            self._unlabelled = self.labels()
        registry.register(self)

    def _new_child(self) -> Child:
        raise NotImplementedError

    def labels(self, *values: str) -> Child:
        """The child of one label set, made at its first call (a dict lookup after)."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            with self._lock:
                child = self._children.get(values)
                if child is None:
                    child = self._children[values] = self._new_child()
        return child


class HistogramChild:
    """One label set's bucket counts (per bucket, not cumulative; +Inf last) and sum."""

    __slots__ = ("_bounds", "_lock", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...], lock: threading.Lock) -> None:
        self._bounds = bounds
        self._lock = lock
        self.counts = [0.0] * (len(bounds) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect_left(self._bounds, value)] += 1.0  # the first bound >= value
            self.sum += value


class PlainHistogram(_LabelSets[HistogramChild]):
    """A histogram, labelled by ``labelnames`` (none: ``observe`` directly), registered
    in ``registry`` as a collector."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
        labelnames: tuple[str, ...] = (),
    ) -> None:
        self._bounds = buckets
        self._le = [floatToGoString(b) for b in (*buckets, float("inf"))]  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, registry, labelnames)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds, self._lock)

    def observe(self, value: float) -> None:
        """An unlabelled histogram's observation."""
        self._unlabelled.observe(value)

    def describe(self) -> list[Metric]:
        return [self._family()]

    def _family(self) -> HistogramMetricFamily:
        """The empty family, its label names known (the docs' reference reads them)."""
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            children = [
                (dict(zip(self.labelnames, values, strict=True)), list(c.counts), c.sum, c.created)
                for values, c in self._children.items()
            ]
        metric = self._family()
        created_too = use_created()
        for labels, counts, total, created in children:
            cumulative = 0.0
            for le, count in zip(self._le, counts, strict=True):
                cumulative += count
                metric.add_sample(f"{self.name}_bucket", {**labels, "le": le}, cumulative)
            metric.add_sample(f"{self.name}_count", labels, cumulative)
            metric.add_sample(f"{self.name}_sum", labels, total)
            if created_too:
                metric.add_sample(f"{self.name}_created", labels, created)
        yield metric


class CounterChild:
    """One label set's count."""

    __slots__ = ("_lock", "created", "value")

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount


class PlainCounter(_LabelSets[CounterChild]):
    """A counter, labelled by ``labelnames`` or not, as plain numbers (a collector): an
    unlabelled one counts from its creation, a label set from its first ``labels``."""

    def _new_child(self) -> CounterChild:
        return CounterChild(self._lock)

    def inc(self, amount: float = 1.0) -> None:
        """Count on an unlabelled counter."""
        self._unlabelled.inc(amount)

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> list[Metric]:
        with self._lock:
            counts = [(values, c.value, c.created) for values, c in self._children.items()]
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        created_too = use_created()
        for values, total, created in counts:
            family.add_metric(values, total, created=created if created_too else None)
        return [family]
