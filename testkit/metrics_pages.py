"""Realistic ``/metrics`` pages for the scraper's tests and benchmark.

``make_vllm_page`` renders, with prometheus_client as vLLM does, the metric families of
vLLM's ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``) with their names and
buckets, once per engine, plus the HTTP metrics of the API server
(prometheus-fastapi-instrumentator) and the client's process/GC collectors. With the
defaults (2 engines, 8 handlers) a page is about 93 KB and 955 lines, within the 50-150
KB of real vLLM pages; 14 of those lines matter to us.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    generate_latest,
)

from extproc.sim.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS  # vLLM's

# A page a real vLLM 0.32 (CPU) served, as it was.
REAL_VLLM_PAGE = Path(__file__).parent / "pages" / "vllm-0.32.0-cpu.txt"
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
HTTP_HIGHR_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5,
    10, 30, 60,
)  # fmt: skip
HANDLERS = (
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health",
    "/metrics", "/tokenize", "/v1/embeddings",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class EngineState:
    """What one engine reports; latency totals are the histograms' running sums."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    itl_sum_s: float = 0.0
    itl_count: int = 0


def make_vllm_page(
    engines: Sequence[EngineState] = (EngineState(), EngineState()),
    *,
    model: str = "meta-llama/Llama-3.1-8B-Instruct",
    handlers: Sequence[str] = HANDLERS,
    legacy_names: bool = False,
) -> str:
    """A vLLM ``/metrics`` page; ``legacy_names`` uses the pre-v0.10 cache/ITL names."""
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    labels = ["model_name", "engine"]

    def gauge(name: str) -> Gauge:
        return Gauge(name, f"{name} gauge.", labels, registry=registry)

    def counter(name: str, extra: Sequence[str] = ()) -> Counter:
        return Counter(name, f"{name} counter.", [*labels, *extra], registry=registry)

    def histogram(name: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, f"{name} histogram.", labels, buckets=buckets, registry=registry)

    kv_name = "vllm:gpu_cache_usage_perc" if legacy_names else "vllm:kv_cache_usage_perc"
    itl_name = (
        "vllm:time_per_output_token_seconds" if legacy_names else "vllm:inter_token_latency_seconds"
    )
    waiting, running, kv = (
        gauge("vllm:num_requests_waiting"),
        gauge("vllm:num_requests_running"),
        gauge(kv_name),
    )
    counters = [
        counter(n)
        for n in (
            "vllm:num_preemptions",
            "vllm:prompt_tokens",
            "vllm:generation_tokens",
            "vllm:prefix_cache_queries",
            "vllm:prefix_cache_hits",
        )
    ]
    success = counter("vllm:request_success", ["finished_reason"])
    ttft = histogram("vllm:time_to_first_token_seconds", TTFT_BUCKETS)
    itl = histogram(itl_name, ITL_BUCKETS)
    others = [
        histogram("vllm:request_time_per_output_token_seconds", ITL_BUCKETS),
        histogram("vllm:iteration_tokens_total", ITERATION_TOKEN_BUCKETS),
        histogram("vllm:request_params_n", (1, 2, 5, 10, 20)),
        *(
            histogram(n, TOKEN_BUCKETS)
            for n in (
                "vllm:request_prompt_tokens",
                "vllm:request_generation_tokens",
                "vllm:request_max_num_generation_tokens",
                "vllm:request_params_max_tokens",
            )
        ),
        *(
            histogram(n, REQUEST_LATENCY_BUCKETS)
            for n in (
                "vllm:e2e_request_latency_seconds",
                "vllm:request_queue_time_seconds",
                "vllm:request_inference_time_seconds",
                "vllm:request_prefill_time_seconds",
                "vllm:request_decode_time_seconds",
            )
        ),
    ]
    for idx, state in enumerate(engines):
        values = (model, str(idx))
        waiting.labels(*values).set(state.waiting)
        running.labels(*values).set(state.running)
        kv.labels(*values).set(state.kv_usage)
        for c in counters:
            c.labels(*values).inc(1234)
        for reason in ("stop", "length", "abort"):
            success.labels(*values, reason).inc(17)
        _set_totals(ttft.labels(*values), state.ttft_sum_s, state.ttft_count)
        _set_totals(itl.labels(*values), state.itl_sum_s, state.itl_count)
        for h in others:
            h.labels(*values).observe(0.7)
    _add_http_metrics(registry, handlers)
    return generate_latest(registry).decode()


def make_sglang_page(
    *,
    waiting: int = 0,
    running: int = 0,
    token_usage: float = 0.0,
    ttft: tuple[float, int] = (0.0, 0),
    itl: tuple[float, int] = (0.0, 0),
    model: str = "qwen/qwen2.5-7b",
) -> str:
    """An SGLang ``/metrics`` page (``sglang:`` gauges and latency histograms)."""
    registry = CollectorRegistry()
    labels = ["model_name", "tp_rank"]
    values = (model, "0")
    for name, value in (
        ("sglang:num_queue_reqs", waiting),
        ("sglang:num_running_reqs", running),
        ("sglang:token_usage", token_usage),
        ("sglang:gen_throughput", 812.5),
    ):
        Gauge(name, name, labels, registry=registry).labels(*values).set(value)
    for name, (total_s, count) in (
        ("sglang:time_to_first_token_seconds", ttft),
        ("sglang:inter_token_latency_seconds", itl),
    ):
        h = Histogram(name, name, labels, buckets=TTFT_BUCKETS, registry=registry)
        _set_totals(h.labels(*values), total_s, count)
    return generate_latest(registry).decode()


def _set_totals(histogram: Histogram, total_s: float, count: int) -> None:
    """Give a histogram child exactly ``count`` observations summing to ``total_s``."""
    if count:
        for _ in range(count - 1):
            histogram.observe(0.0)
        histogram.observe(total_s)


def _add_http_metrics(registry: CollectorRegistry, handlers: Sequence[str]) -> None:
    requests = Counter(
        "http_requests", "Total HTTP requests.", ["handler", "method", "status"], registry=registry
    )
    sizes = [
        Summary(n, n, ["handler"], registry=registry)
        for n in ("http_request_size_bytes", "http_response_size_bytes")
    ]
    highr = Histogram(
        "http_request_duration_highr_seconds",
        "Latency with many buckets but no labels.",
        buckets=HTTP_HIGHR_BUCKETS,
        registry=registry,
    )
    duration = Histogram(
        "http_request_duration_seconds",
        "Latency with only few buckets by handler.",
        ["handler", "method"],
        buckets=(0.1, 0.5, 1.0),
        registry=registry,
    )
    for handler in handlers:
        for status in ("2xx", "4xx", "5xx"):
            requests.labels(handler, "POST", status).inc(3)
        for s in sizes:
            s.labels(handler).observe(512)
        duration.labels(handler, "POST").observe(0.2)
        highr.observe(0.2)
