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

The series are kept here as plain numbers and exposed by a collector: prometheus-client's
``Histogram.observe`` takes two locks and walks the buckets in Python (about 1 us each),
five times a request on the request path; here one lock and a ``bisect`` each.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from extproc.routing.observe import Ended, Routed

# An LLM request takes from milliseconds (a cached short prompt's first token) to minutes
# (a long generation, a queue).
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)  # fmt: skip
# Headers and bodies: from a short chat turn to a long context or a long streamed answer.
BYTES_BUCKETS = tuple(float(4**n) for n in range(4, 13))  # 256 B .. 16 MiB
ATTEMPTS_BUCKETS = (1.0, 2.0, 3.0, 4.0, 6.0, 10.0)

UNKNOWN = "unknown"
LABELS = ("model", "pod")

# (name, help, buckets) of each histogram, in the order ``_Series.histograms`` holds them.
HISTOGRAMS = (
    (
        "extproc_request_first_byte_seconds",
        (
            "From the request's first byte at Envoy to the first byte of the upstream response "
            "(a streamed response's first token, plus the hop), by model and pod."
        ),
        SECONDS_BUCKETS,
    ),
    (
        "extproc_request_duration_seconds",
        (
            "From the request's first byte at Envoy to the last byte sent to the client, by "
            "model and pod."
        ),
        SECONDS_BUCKETS,
    ),
    (
        "extproc_request_bytes",
        "Request headers and body, in bytes, by model and pod.",
        BYTES_BUCKETS,
    ),
    (
        "extproc_response_bytes",
        "Response headers and body, in bytes, by model and pod.",
        BYTES_BUCKETS,
    ),
    (
        "extproc_request_attempts",
        "Upstream attempts per request (1: no retry), by model and the pod that served.",
        ATTEMPTS_BUCKETS,
    ),
)
FIRST_BYTE, DURATION, REQUEST_BYTES, RESPONSE_BYTES, ATTEMPTS = range(len(HISTOGRAMS))
# Each histogram's ``le`` labels, +Inf last, as prometheus-client writes them.
LE: tuple[tuple[str, ...], ...] = tuple(
    tuple(floatToGoString(b) for b in (*buckets, float("inf")))  # type: ignore[no-untyped-call]
    for _, _, buckets in HISTOGRAMS
)
PROMPT_TOKENS = (
    "extproc_routed_prompt_tokens",
    (
        "Prompt tokens of the requests routed here that ended successfully, by model and the "
        "pod that served (exact in precise mode, else estimated from bytes)."
    ),
)
PREDICTED_CACHED = (
    "extproc_predicted_cached_tokens",
    (
        "Prompt tokens the scheduler predicted the serving pod held cached, for the requests "
        "routed here that ended successfully, by model and pod."
    ),
)


class _Histogram:
    """One series' bucket counts (not cumulative; the last is +Inf) and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.sum += value


class _Series:
    """One (model, pod)'s histograms and token counts."""

    __slots__ = ("histograms", "predicted_cached", "prompt_tokens")

    def __init__(self) -> None:
        self.histograms = tuple(_Histogram(buckets) for _, _, buckets in HISTOGRAMS)
        self.prompt_tokens = 0
        self.predicted_cached = 0


class OutcomeMetrics:
    """Fills the per-request outcome series on each end (a ``RouteObserver``) and exposes
    them to ``registry`` (a collector)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._series: dict[tuple[str, str], _Series] = {}
        self._lock = threading.Lock()  # ends may come from several access-log threads
        registry.register(self)

    def routed(self, routed: Routed) -> None:
        """Nothing: the figures come with the end."""

    def ended(self, ended: Ended) -> None:
        key = (ended.model or UNKNOWN, UNKNOWN if ended.pod is None else str(ended.pod))
        timing = ended.timing
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _Series()
            histograms = series.histograms
            histograms[ATTEMPTS].observe(ended.attempts)
            if timing is not None:
                if timing.first_upstream_byte_s is not None:
                    histograms[FIRST_BYTE].observe(timing.first_upstream_byte_s)
                if timing.duration_s is not None:
                    histograms[DURATION].observe(timing.duration_s)
                histograms[REQUEST_BYTES].observe(timing.request_bytes)
                histograms[RESPONSE_BYTES].observe(timing.response_bytes)
            if ended.succeeded and ended.prompt_tokens is not None:
                series.prompt_tokens += ended.prompt_tokens
                series.predicted_cached += ended.predicted_cached_tokens or 0

    def describe(self) -> Iterator[Metric]:
        return self._families({})

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            copies = {
                key: (
                    [(list(h.counts), h.sum) for h in s.histograms],
                    s.prompt_tokens,
                    s.predicted_cached,
                )
                for key, s in self._series.items()
            }
        return self._families(copies)

    @staticmethod
    def _families(
        series: dict[tuple[str, str], tuple[list[tuple[list[int], float]], int, int]],
    ) -> Iterator[Metric]:
        for i, (name, doc, _) in enumerate(HISTOGRAMS):
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            for labels, (histograms, _, _) in series.items():
                counts, total = histograms[i]
                cumulative, buckets = 0, []
                for le, count in zip(LE[i], counts, strict=True):
                    cumulative += count
                    buckets.append((le, cumulative))
                family.add_metric(list(labels), buckets, total)
            yield family
        prompt = CounterMetricFamily(*PROMPT_TOKENS, labels=LABELS)
        cached = CounterMetricFamily(*PREDICTED_CACHED, labels=LABELS)
        for labels, (_, prompt_tokens, predicted_cached) in series.items():
            prompt.add_metric(list(labels), prompt_tokens)
            cached.add_metric(list(labels), predicted_cached)
        yield prompt
        yield cached
