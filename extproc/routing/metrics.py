"""The router's Prometheus metrics: decisions, errors, completions, pods, pending.

Those touched on every request (the decisions by model, the scheduling time, the
completions by outcome) are kept as plain numbers behind collectors
(``extproc.plain_metrics``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.plain_metrics import PlainCounter, PlainHistogram

SCHEDULING_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = PlainCounter(
            "extproc_route_decisions",
            "Requests routed (a destination list was returned), by model.",
            registry,
            ("model",),
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
        self.completions = PlainCounter(
            "extproc_completions",
            "Routed requests whose end Envoy reported, by outcome (recorded, failed, "
            "unknown_request, unknown_pod; recorded_from_metadata: routed by another "
            "replica, recorded from the record it carried; abandoned: Envoy stopped "
            "waiting for the route).",
            registry,
            ("outcome",),
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
        self.rewrites = Counter(
            "extproc_model_rewrites",
            "Requests whose model a rewrite rule matched, by the model asked and the "
            "target chosen (the target may be the model itself: not rewritten).",
            ["model", "target"],
            registry=registry,
        )
        self._rewrites: dict[tuple[str, str], Any] = {}
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
        self.decisions.labels(model).inc()

    def rewritten(self, model: str, target: str) -> None:
        child = self._rewrites.get((model, target))
        if child is None:
            child = self._rewrites[model, target] = self.rewrites.labels(model, target)
        child.inc()
