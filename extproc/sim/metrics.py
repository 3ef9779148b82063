"""A pod's ``/metrics``: vLLM's metric names, types, labels and buckets, one registry per pod.

Names and buckets follow vLLM's ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``).
Every series has the labels ``model_name`` and ``engine="0"``; ``vllm:cache_config_info``
(a gauge fixed at 1, vLLM's stand-in for an info metric) carries the cache settings as
labels plus ``engine``. Gauges and counters are read from the engine at scrape time;
the running, waiting and KV-cache use gauges as of the end of the engine's last step, as
vLLM's (``EngineStats.step_running``: requests aborted since still show until the next
step); the latency histograms are observed as tokens are sampled.

With LoRA on, ``vllm:lora_requests_info`` is vLLM's: a gauge with only the labels
``max_lora``, ``waiting_lora_adapters`` and ``running_lora_adapters`` (adapter names
joined by commas, "" for none; see ``Engine.lora_request_states`` for which), set to the
time of the update after every step. As with vLLM's ``prometheus_client`` gauge, every
label combination seen stays on the page with the time it was last set, so a reader
takes the series with the largest value. ``sim:lora_loads_total`` (the sim's own) counts
the adapters brought into a GPU slot.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.sim.engine import Engine, StepResult

LABELS = ("model_name", "engine")
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _EngineCollector(Collector):
    """Scheduler gauges and counters, read from the engine on every scrape."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name, "0"]

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        labels = list(LABELS)
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             s.step_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             s.step_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             s.step_kv_cache_usage),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(self._labels, value)
            yield gauge
        for name, doc, value in (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             s.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             s.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.num_prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             s.num_generation_tokens),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(self._labels, value)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        success.add_metric([*self._labels, "length"], s.num_finished_requests)
        yield success
        cfg = self._engine.config
        if cfg.enable_lora:
            loads = CounterMetricFamily(
                "sim:lora_loads", "LoRA adapters brought into a GPU slot.", labels=labels
            )
            loads.add_metric(self._labels, s.num_lora_loads)
            yield loads
        info = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "num_gpu_blocks": str(cfg.num_gpu_blocks),
            "prefix_caching_hash_algo": "sha256",
            "engine": "0",
        }
        cache_info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(info),
        )
        cache_info.add_metric(list(info.values()), 1.0)
        yield cache_info


class PodMetrics:
    """The registry of one pod; ``observe`` each step, ``render`` on scrape."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model_name))
        self._engine = engine
        self._lora_info: Gauge | None = None
        if engine.config.enable_lora:
            self._lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
            )
        values = (model_name, "0")

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets)
            return h.labels(*values)

        self._ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self._itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

    def observe(self, result: StepResult) -> None:
        for out in result.outputs:
            (self._ttft if out.index == 0 else self._itl).observe(out.latency_s)
        for fin in result.finished:
            self._e2e.observe(fin.e2e_s)
            self._queue.observe(fin.queue_s)
        if self._lora_info is not None:
            names = ",".join(self._engine.lora_request_states())
            max_lora = str(self._engine.config.max_loras)
            self._lora_info.labels(max_lora, names, names).set_to_current_time()

    def render(self, names: Sequence[str] = ()) -> bytes:
        """The page; with ``names``, only those samples (vLLM's ``/metrics/?name[]=``)."""
        if names:
            return generate_latest(self.registry.restricted_registry(names))
        return generate_latest(self.registry)
