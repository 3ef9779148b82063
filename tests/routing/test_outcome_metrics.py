"""Per-request outcome metrics: each end fills its model's and pod's series."""

from __future__ import annotations

import orjson
import pytest
from prometheus_client import CollectorRegistry, Histogram

from extproc.routing.observe import Ended, EndTiming
from extproc.routing.outcome_metrics import LABELS, SECONDS_BUCKETS, OutcomeMetrics
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, load_config
from testkit.factories import make_pod

PATH = "/v1/completions"
PROMPT = "hello there " * 40  # 480 bytes: 120 tokens estimated, 7.5 blocks of 64 bytes


def body(model: str = "m", prompt: str = PROMPT) -> bytes:
    return orjson.dumps({"model": model, "prompt": prompt, "max_tokens": 8})


def make_router(config: str | None = None) -> tuple[Router, CollectorRegistry]:
    registry = CollectorRegistry()
    router = Router(
        build_scheduler(load_config(config), CollectorRegistry()),
        [make_pod(f"p{i}", port=8000 + i) for i in range(3)],
        registry=registry,
    )
    router.observers.append(OutcomeMetrics(registry))
    return router, registry


def value(registry: CollectorRegistry, name: str, model: str, pod: str) -> float:
    return registry.get_sample_value(name, {"model": model, "pod": pod}) or 0.0


def serve(router: Router, request_id: str, ok: bool = True, timing: EndTiming | None = None) -> str:
    """Route ``request_id`` and end it on its pick; the pick's label."""
    pick = router.route(PATH, body(), request_id=request_id).pods[0]
    timing = timing or EndTiming(0.02, 0.5, 600, 3000, 200 if ok else 503)
    router.complete(request_id, pick.address, succeeded=ok, attempts=1, timing=timing)
    return str(pick.id)


def test_each_end_fills_its_model_and_pods_histograms() -> None:
    router, registry = make_router()
    pod = serve(router, "r1", timing=EndTiming(0.02, 0.5, 600, 3000, 200))
    serve(router, "r2", timing=EndTiming(0.04, 1.5, 700, 5000, 200))  # same prefix: same pod
    assert value(registry, "extproc_request_first_byte_seconds_count", "m", pod) == 2
    assert value(registry, "extproc_request_first_byte_seconds_sum", "m", pod) == pytest.approx(
        0.06
    )
    assert value(registry, "extproc_request_duration_seconds_sum", "m", pod) == pytest.approx(2.0)
    assert value(registry, "extproc_request_bytes_sum", "m", pod) == 1300
    assert value(registry, "extproc_response_bytes_sum", "m", pod) == 8000
    assert value(registry, "extproc_request_attempts_sum", "m", pod) == 2
    others = {str(p.id) for p in router.pods} - {pod}
    for other in others:
        assert value(registry, "extproc_request_duration_seconds_count", "m", other) == 0


def test_a_success_counts_its_prompt_and_the_predicted_cached_tokens_on_its_pod() -> None:
    router, registry = make_router()  # the default: estimated-ttft's approximate view
    pod = serve(router, "r1")
    assert value(registry, "extproc_routed_prompt_tokens_total", "m", pod) == 120
    assert value(registry, "extproc_predicted_cached_tokens_total", "m", pod) == 0  # cold
    assert serve(router, "r2") == pod
    assert value(registry, "extproc_routed_prompt_tokens_total", "m", pod) == 240
    # Its 8 blocks (the last one short) recorded: the whole prompt held, none to prefill.
    assert value(registry, "extproc_predicted_cached_tokens_total", "m", pod) == 120


def test_kthena_prefix_cache_alone_predicts_from_its_view() -> None:
    router, registry = make_router("kthena")
    pod = serve(router, "r1")
    assert serve(router, "r2") == pod
    assert value(registry, "extproc_predicted_cached_tokens_total", "m", pod) == 120


def test_a_failed_request_is_timed_but_not_counted_as_routed_or_predicted() -> None:
    router, registry = make_router()
    pod = serve(router, "r1", ok=False)
    assert value(registry, "extproc_request_duration_seconds_count", "m", pod) == 1
    assert value(registry, "extproc_routed_prompt_tokens_total", "m", pod) == 0
    assert value(registry, "extproc_predicted_cached_tokens_total", "m", pod) == 0


def test_an_unknown_request_and_pod_are_timed_as_unknown_and_not_counted() -> None:
    router, registry = make_router()
    timing = EndTiming(0.02, 0.5, 600, 3000, 200)
    router.complete("nobody", router.pods[1].address, succeeded=True, timing=timing)
    router.complete("nobody-either", "10.9.9.9:80", succeeded=True, timing=timing)
    known = str(router.pods[1].id)
    assert value(registry, "extproc_request_duration_seconds_count", "unknown", known) == 1
    assert value(registry, "extproc_request_duration_seconds_count", "unknown", "unknown") == 1
    for pod in (known, "unknown"):
        assert value(registry, "extproc_routed_prompt_tokens_total", "unknown", pod) == 0


def test_an_end_without_timing_counts_attempts_only() -> None:
    router, registry = make_router()
    pick = router.route(PATH, body(), request_id="r1").pods[0]
    router.complete("r1", pick.address, succeeded=True, attempts=2)
    pod = str(pick.id)
    assert value(registry, "extproc_request_attempts_sum", "m", pod) == 2
    assert value(registry, "extproc_request_duration_seconds_count", "m", pod) == 0
    assert value(registry, "extproc_routed_prompt_tokens_total", "m", pod) == 120


@pytest.mark.parametrize(
    "values", [[1.0, 2.0, 3.5, 10.0, 11.0], [0.0, 0.005, 0.0051, 600.0, 601.0]]
)
def test_buckets_count_as_prometheus_clients_histogram(values: list[float]) -> None:
    """The hand-kept buckets (a bound counts the values equal to it) against the
    library's own Histogram fed the same values."""
    registry, reference = CollectorRegistry(), CollectorRegistry()
    metrics = OutcomeMetrics(registry)
    histogram = Histogram(
        "extproc_request_duration_seconds", "", LABELS, registry=reference, buckets=SECONDS_BUCKETS
    )
    for v in values:
        metrics.ended(Ended("r", "m", None, True, 1, EndTiming(None, v, 0, 0, 200)))
        histogram.labels("m", "unknown").observe(v)
    name = "extproc_request_duration_seconds"

    def samples(r: CollectorRegistry) -> set[tuple[str, str, float]]:
        return {
            (s.name, s.labels.get("le", ""), s.value)
            for m in r.collect()
            if m.name == name
            for s in m.samples
            if not s.name.endswith("_created")
        }

    assert samples(registry) == samples(reference)
