"""Per-request outcome metrics, from the access-log entry each request's end brings.

A ``RouteObserver`` (``routing.observe``): on each end Envoy reports, per model and pod
that served (``namespace/name``; ``unknown`` when not known), histograms of the time to
the first upstream byte, the total duration, the request and response bytes and the
upstream attempts; and, for a request routed here that succeeded, the prompt tokens and
the cached tokens the scheduler predicted on the pod that served
(``extproc_routed_prompt_tokens_total``, ``extproc_predicted_cached_tokens_total``), to
set beside the engines' own ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total``. In precise mode those two are token-exact; otherwise
they are the approximate view's estimate (bytes / 4). Which mode made a figure is not a
label, to keep the series few (docs/metrics.md).
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram

from extproc.routing.observe import Ended, Routed

# An LLM request takes from milliseconds (a cached short prompt's first token) to minutes
# (a long generation, a queue).
SECONDS_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
# Headers and bodies: from a short chat turn to a long context or a long streamed answer.
BYTES_BUCKETS = tuple(float(4**n) for n in range(4, 13))  # 256 B .. 16 MiB
ATTEMPTS_BUCKETS = (1.0, 2.0, 3.0, 4.0, 6.0, 10.0)

UNKNOWN = "unknown"
LABELS = ("model", "pod")


class _Children(NamedTuple):
    """One (model, pod)'s series, looked up once: ``labels()`` costs microseconds."""

    first_byte: Histogram
    duration: Histogram
    request_bytes: Histogram
    response_bytes: Histogram
    attempts: Histogram
    prompt_tokens: Counter
    predicted_cached: Counter


class OutcomeMetrics:
    """Fills the per-request outcome series on each end (a ``RouteObserver``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=registry, buckets=buckets)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry)

        self.first_byte = histogram(
            "extproc_request_first_byte_seconds",
            "From the request's first byte at Envoy to the first byte of the upstream "
            "response (a streamed response's first token, plus the hop), by model and pod.",
            SECONDS_BUCKETS,
        )
        self.duration = histogram(
            "extproc_request_duration_seconds",
            "From the request's first byte at Envoy to the last byte sent to the client, "
            "by model and pod.",
            SECONDS_BUCKETS,
        )
        self.request_bytes = histogram(
            "extproc_request_bytes",
            "Request headers and body, in bytes, by model and pod.",
            BYTES_BUCKETS,
        )
        self.response_bytes = histogram(
            "extproc_response_bytes",
            "Response headers and body, in bytes, by model and pod.",
            BYTES_BUCKETS,
        )
        self.attempts = histogram(
            "extproc_request_attempts",
            "Upstream attempts per request (1: no retry), by model and the pod that served.",
            ATTEMPTS_BUCKETS,
        )
        self.prompt_tokens = counter(
            "extproc_routed_prompt_tokens",
            "Prompt tokens of the requests routed here that ended successfully, by model "
            "and the pod that served (exact in precise mode, else estimated from bytes).",
        )
        self.predicted_cached = counter(
            "extproc_predicted_cached_tokens",
            "Prompt tokens the scheduler predicted the serving pod held cached, for the "
            "requests routed here that ended successfully, by model and pod.",
        )
        self._children = cache(self._lookup)

    def _lookup(self, model: str, pod: str) -> _Children:
        return _Children(
            self.first_byte.labels(model, pod),
            self.duration.labels(model, pod),
            self.request_bytes.labels(model, pod),
            self.response_bytes.labels(model, pod),
            self.attempts.labels(model, pod),
            self.prompt_tokens.labels(model, pod),
            self.predicted_cached.labels(model, pod),
        )

    def routed(self, routed: Routed) -> None:
        """Nothing: the figures come with the end."""

    def ended(self, ended: Ended) -> None:
        pod = ended.pod
        series = self._children(ended.model or UNKNOWN, UNKNOWN if pod is None else str(pod))
        series.attempts.observe(ended.attempts)
        timing = ended.timing
        if timing is not None:
            if timing.first_upstream_byte_s is not None:
                series.first_byte.observe(timing.first_upstream_byte_s)
            if timing.duration_s is not None:
                series.duration.observe(timing.duration_s)
            series.request_bytes.observe(timing.request_bytes)
            series.response_bytes.observe(timing.response_bytes)
        if ended.succeeded and ended.prompt_tokens is not None:
            series.prompt_tokens.inc(ended.prompt_tokens)
            series.predicted_cached.inc(ended.predicted_cached_tokens or 0)
