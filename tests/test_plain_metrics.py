"""The per-request metrics kept as plain numbers (``extproc.plain_metrics``) are exposed
exactly as prometheus-client exposes its own Counter and Histogram."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from extproc.plain_metrics import PlainCounter, PlainHistogram
from extproc.routing.metrics import SCHEDULING_BUCKETS

DECISIONS = ("extproc_route_decisions", "Requests routed, by model.")
SCHEDULING = ("extproc_scheduling_duration_seconds", "Time to schedule one request.")
# Below, on and between the bounds, and above the last.
TIMES = (0.0, 0.00005, 0.00007, 0.0001, 0.003, 0.05, 0.2, 1e-9)


def _exposition(registry: CollectorRegistry) -> str:
    """The text format, creation times masked (each metric has its own)."""
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", generate_latest(registry).decode())


def test_plain_metrics_expose_what_prometheus_client_would() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter = Counter(*DECISIONS, ["model"], registry=theirs)
    histogram = Histogram(*SCHEDULING, registry=theirs, buckets=SCHEDULING_BUCKETS)
    model_counter = PlainCounter(*DECISIONS, ours, ("model",))
    plain_histogram = PlainHistogram(*SCHEDULING, SCHEDULING_BUCKETS, ours)
    assert _exposition(ours) == _exposition(theirs)  # before any request
    for model in ("m", "m", "other", "m"):
        counter.labels(model).inc()
        model_counter.labels(model).inc()
    for seconds in TIMES:
        histogram.observe(seconds)
        plain_histogram.observe(seconds)
    exposed = _exposition(ours)
    assert exposed == _exposition(theirs)
    assert 'extproc_route_decisions_total{model="m"} 3.0' in exposed
    assert model_counter.labels("m").value == 3
    assert "extproc_route_decisions_created" in exposed  # the creation times are there too


def test_a_labelled_plain_histogram_exposes_what_prometheus_client_would() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    labels = ("plugin", "extension_point")
    histogram = Histogram(*SCHEDULING, labels, registry=theirs, buckets=SCHEDULING_BUCKETS)
    plain = PlainHistogram(*SCHEDULING, SCHEDULING_BUCKETS, ours, labels)
    assert _exposition(ours) == _exposition(theirs)  # no child yet: no sample
    for n, seconds in enumerate(TIMES):
        values = ("estimated-ttft", "score") if n % 3 else ("least-request", "filter")
        histogram.labels(*values).observe(seconds)
        plain.labels(*values).observe(seconds)
    assert _exposition(ours) == _exposition(theirs)


def test_plain_counters_with_two_labels_and_none_expose_what_prometheus_client_would() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    labels = ("priority", "reason")
    counter = Counter("extproc_flow_dispatched", "Let through.", labels, registry=theirs)
    plain = PlainCounter("extproc_flow_dispatched", "Let through.", ours, labels)
    retries = Counter("extproc_retries_observed", "Beyond the first.", registry=theirs)
    plain_retries = PlainCounter("extproc_retries_observed", "Beyond the first.", ours)
    assert _exposition(ours) == _exposition(theirs)  # the unlabelled one at 0 already
    for n in range(7):
        values = ("0", "not_saturated") if n % 3 else ("100", "capacity")
        counter.labels(*values).inc()
        plain.labels(*values).inc()
        retries.inc(n)
        plain_retries.inc(n)
    exposed = _exposition(ours)
    assert exposed == _exposition(theirs)
    assert 'extproc_flow_dispatched_total{priority="0",reason="not_saturated"} 4.0' in exposed
    assert "extproc_retries_observed_total 21.0" in exposed


def test_a_label_set_of_the_wrong_size_is_refused_by_both_kinds() -> None:
    registry = CollectorRegistry()
    counter = PlainCounter("c", "C.", registry, ("priority", "reason"))
    histogram = PlainHistogram(*SCHEDULING, SCHEDULING_BUCKETS, registry, ("plugin",))
    with pytest.raises(ValueError, match="expected labels"):
        counter.labels("0")
    with pytest.raises(ValueError, match="expected labels"):
        histogram.labels("a", "b")
    assert counter.labels("0", "capacity") is counter.labels("0", "capacity")
