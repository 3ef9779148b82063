"""Flow control's Prometheus metrics: the queue per band, time queued, dispatches,
refusals, cancellations and the saturation state per model."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.plain_metrics import PlainCounter
from extproc.routing.flow.saturation import FROZEN_S

QUEUED_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_requests = Gauge(
            "extproc_flow_queue_requests",
            "Requests held in flow control's queue, by model and priority band (an "
            "autoscaling signal: work the pods had no room for).",
            ["model", "priority"],
            registry=registry,
        )
        self.queue_bytes = Gauge(
            "extproc_flow_queue_bytes",
            "Body bytes of the requests held in the queue, by model and priority band.",
            ["model", "priority"],
            registry=registry,
        )
        self.queued = Histogram(
            "extproc_flow_queued_seconds",
            "Time a request spent held in the queue, by priority band and how it left "
            "(dispatched, refused, cancelled).",
            ["priority", "outcome"],
            registry=registry,
            buckets=QUEUED_BUCKETS,
        )
        self.dispatched = PlainCounter(  # counts every request: plain numbers
            "extproc_flow_dispatched",
            "Requests flow control let through, by priority band and reason "
            "(not_saturated: at once; capacity: from the queue when a pod had room; "
            "drain: from the queue when extproc stopped).",
            registry,
            ("priority", "reason"),
        )
        self.refused = Counter(
            "extproc_flow_refused",
            "Requests flow control answered 429 with Retry-After, by priority band and "
            "reason (shed: sheddable while saturated; queue_full; evicted: by a higher "
            "priority when full; queue_timeout: the band's time to live ended).",
            ["priority", "reason"],
            registry=registry,
        )
        self.cancelled = Counter(
            "extproc_flow_cancelled",
            "Held requests whose client went away before they were dispatched.",
            ["priority"],
            registry=registry,
        )
        self.saturated = Gauge(
            "extproc_flow_saturated",
            "1 while flow control holds the model's requests: every ready pod serving "
            "it is over its limits (or, with reservedSlots, only the reserve is left, for "
            "a band below reservedFor), else 0; as of its last request or dispatch.",
            ["model"],
            registry=registry,
        )
        self.frozen_pods = Gauge(
            "extproc_flow_frozen_pods",
            f"Pods over their limits by a reading that has not changed for {FROZEN_S:g} s while "
            "nothing was in flight to them (vLLM keeps its gauges after aborting every "
            "request it ran, until its next step): each takes one request at a time.",
            registry=registry,
        )
        self.default_objective = Counter(
            "extproc_flow_default_priority",
            "Requests given the default priority although they named an objective, by "
            "reason (unknown: no such objective; malformed: not an object name).",
            ["reason"],
            registry=registry,
        )
