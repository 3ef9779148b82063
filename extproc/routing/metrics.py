"""The router's Prometheus metrics: decisions, errors, completions, pods, pending.

The two touched on every decision (the decisions by model, the scheduling time) are kept
as plain numbers and exposed by collectors, as prometheus-client would expose them (the
same families, samples and creation times): its ``Counter.inc`` and ``Histogram.observe``
check the metric, take locks and walk the buckets in Python; here one lock and a
``bisect``.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.utils import floatToGoString

SCHEDULING_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = ModelCounter(
            "extproc_route_decisions",
            "Requests routed (a destination list was returned), by model.",
            registry,
        )
        self.errors = Counter(
            "extproc_route_errors",
            "Requests answered with an error instead of a route, by HTTP status and code.",
            ["status", "code"],
            registry=registry,
        )
        self.scheduling = PlainHistogram(
            "extproc_scheduling_duration_seconds",
            "Time to parse, render, hash and schedule one request.",
            SCHEDULING_BUCKETS,
            registry,
        )
        self.completions = Counter(
            "extproc_completions",
            "Routed requests whose end Envoy reported, by outcome (recorded, failed, "
            "unknown_request, unknown_pod; recorded_from_metadata: routed by another "
            "replica, recorded from the record it carried; abandoned: Envoy stopped "
            "waiting for the route).",
            ["outcome"],
            registry=registry,
        )
        self.retries = Counter(
            "extproc_retries_observed",
            "Upstream attempts beyond the first, as reported by Envoy's access log.",
            registry=registry,
        )
        self.pinned = Counter(
            "extproc_session_pinned",
            "Requests sent to their session's bound pod without scoring (session sticky).",
            registry=registry,
        )
        self.bad_records = Counter(
            "extproc_record_metadata_invalid",
            "Access-log entries whose extproc.record metadata was malformed (not "
            "recorded), by the field at fault.",
            ["reason"],
            registry=registry,
        )
        self.ended_elsewhere = Counter(
            "extproc_ended_elsewhere",
            "Requests routed here whose end another replica reported (through Redis).",
            registry=registry,
        )
        unknown_pod = Counter(
            "extproc_shared_records_unknown_pod",
            "Other replicas' picks (start) and records (end) for pods this replica does "
            "not know (skipped).",
            ["kind"],
            registry=registry,
        )
        self.shared_unknown_pod = {k: unknown_pod.labels(k) for k in ("start", "end")}
        self.pods_ready = Gauge(
            "extproc_pods_ready", "Known pods that are ready to take requests.", registry=registry
        )
        self.pods_known = Gauge("extproc_pods_known", "Known pods.", registry=registry)
        self.pending = Gauge(
            "extproc_pending_completions",
            "Routed requests awaiting their end (bounded in size and age).",
            registry=registry,
        )
        self.preparing = Gauge(
            "extproc_preparing_requests",
            "Requests whose slow preparation (tokenizing, precise-prefix-cache) waits or "
            "runs on the preparing threads (at most --prepare-queue).",
            registry=registry,
        )
        # Children looked up once: ``labels()`` costs microseconds on every request.
        self.outcome = {
            o: self.completions.labels(o)
            for o in (
                "recorded",
                "recorded_from_metadata",
                "failed",
                "unknown_request",
                "unknown_pod",
                "abandoned",
            )
        }

    def decided(self, model: str) -> None:
        self.decisions.inc(model)


def _use_created() -> bool:
    """Whether prometheus-client writes ``_created`` samples (it can be told not to)."""
    return bool(getattr(prometheus_metrics, "_use_created", True))


class ModelCounter:
    """A counter labelled by model, as plain numbers (a collector)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self._counts: dict[str, list[float]] = {}  # model -> [count, created]
        self._lock = threading.Lock()
        registry.register(self)

    def inc(self, model: str) -> None:
        with self._lock:
            count = self._counts.get(model)
            if count is None:
                self._counts[model] = [1.0, time.time()]
            else:
                count[0] += 1.0

    def value(self, model: str) -> float:
        """The count for ``model`` (0 before its first)."""
        count = self._counts.get(model)
        return 0.0 if count is None else count[0]

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=("model",))]

    def collect(self) -> list[Metric]:
        with self._lock:
            counts = [(model, total, created) for model, (total, created) in self._counts.items()]
        family = CounterMetricFamily(self.name, self.documentation, labels=("model",))
        created_too = _use_created()
        for model, total, created in counts:
            family.add_metric((model,), total, created=created if created_too else None)
        return [family]


class PlainHistogram:
    """A histogram without labels, as plain numbers (a collector)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = buckets
        self._le = [floatToGoString(b) for b in (*buckets, float("inf"))]  # type: ignore[no-untyped-call]
        self._counts = [0.0] * (len(buckets) + 1)  # per bucket, not cumulative; +Inf last
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect_left(self._bounds, value)] += 1.0  # the first bound >= value
            self._sum += value

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, "histogram")]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        metric = Metric(self.name, self.documentation, "histogram")
        cumulative = 0.0
        for le, count in zip(self._le, counts, strict=True):
            cumulative += count
            metric.add_sample(f"{self.name}_bucket", {"le": le}, cumulative)
        metric.add_sample(f"{self.name}_count", {}, cumulative)
        metric.add_sample(f"{self.name}_sum", {}, total)
        if _use_created():
            metric.add_sample(f"{self.name}_created", {}, self._created)
        yield metric
