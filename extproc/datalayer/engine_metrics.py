"""A pod's ``/metrics`` page -> ``PodMetrics``: the few vLLM and SGLang series we read.

Series read; for each quantity the first name present on the page wins:

* ``waiting``: ``vllm:num_requests_waiting`` | ``sglang:num_queue_reqs``
* ``running``: ``vllm:num_requests_running`` | ``sglang:num_running_reqs``
* ``kv_usage``: ``vllm:kv_cache_usage_perc`` | ``vllm:gpu_cache_usage_perc`` (vLLM before
  0.10) | ``sglang:token_usage``
* ``ttft_s`` (histogram): ``vllm:time_to_first_token_seconds`` |
  ``sglang:time_to_first_token_seconds``
* ``itl_s`` (histogram): ``vllm:inter_token_latency_seconds`` |
  ``vllm:time_per_output_token_seconds`` (older vLLM) |
  ``sglang:inter_token_latency_seconds`` | ``sglang:time_per_output_token_seconds``
* ``kv_capacity_tokens``: ``vllm:cache_config_info``, vLLM's info gauge whose labels are
  its ``CacheConfig``: ``num_gpu_blocks * block_size`` summed over its series (one per
  engine). A series whose two labels are not positive integers (vLLM writes ``None``
  for a value it does not know) counts nothing; ``None`` when no series counts.
* ``prefix_cache_hits`` / ``prefix_cache_queries`` (counters, prompt tokens found cached
  / looked up): ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` |
  ``vllm:gpu_prefix_cache_hits_total`` / ``vllm:gpu_prefix_cache_queries_total`` (older
  vLLM), published as their increase since the pod's first scrape (``CounterSince``), so
  their ratio is the hit ratio the engine saw while extproc routed to it; ``None`` when
  the page has neither pair (SGLang).
* ``lora`` (``LoraSlots``): ``vllm:lora_requests_info``, vLLM's gauge whose labels
  ``running_lora_adapters`` and ``waiting_lora_adapters`` (comma-separated names, ``""``
  for none) and ``max_lora`` describe its LoRA slots, and whose value is when it was
  set (a Unix time). vLLM keeps every label set it ever wrote, so the page lists old
  series too: the current one is the greatest value among the series naming some
  adapter (a label not ``""``), or, when none does, among all (as the Gateway API
  Inference Extension reads it, which keeps the last adapters seen while the engine
  idles: their weights are likely still in its slots). Names are stripped, empty ones
  dropped. ``None`` when the page has no series, or when the current series'
  ``max_lora`` is not a count (logged once per pod: a malformed label must not fail
  the scrape of the other quantities).

Label sets: counts and histogram totals are summed over label sets (a data-parallel
vLLM server exposes one per engine); ``kv_usage`` is their mean. When series carry a
``model_name`` label and some name one of the pod's models, only those count; when none
does, all count, so a served-model name that differs from the configured one does not
blind the scheduler. ``vllm:cache_config_info`` and ``vllm:lora_requests_info`` carry no
``model_name`` and always count.

Recent latency (``LatencyWindow``): the mean of the observations made between the last
two successful scrapes, delta ``_sum`` / delta ``_count``. Without new observations
the last mean is kept for ``hold_s`` (default 10 s), then it is ``None``; a count that
went down (the engine restarted) starts a new baseline.

Cost: a full vLLM page is almost all histogram buckets we do not need, and
prometheus_client's parser is slow per sample line (it walks label strings a
character at a time). So ``PageParser`` first keeps only the lines of the series above
(a set lookup on each line's first bytes), then parses each distinct series text once
with ``text_string_to_metric_families`` and caches its name and labels; the value is
read with ``float``, as the parser itself does. The ``vllm:lora_requests_info`` lines
grow with every combination of adapters a vLLM has run: the current one is chosen from
the lines' bytes and only it is parsed (an old series costs about 2 us a scrape, not
5). ``bench/scrape.py`` measures both (figures: docs/performance.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from extproc.pods import LoraSlots, PodMetrics

log = logging.getLogger("extproc.datalayer.engine_metrics")

WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
TTFT = ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")
ITL = (
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:time_per_output_token_seconds",
)
CACHE_CONFIG = "vllm:cache_config_info"
CACHE_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
CACHE_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
LORA_INFO = "vllm:lora_requests_info"
_RUNNING_LABEL, _WAITING_LABEL = "running_lora_adapters", "waiting_lora_adapters"
_LORA_KEY = LORA_INFO.encode()
_NO_ADAPTERS = tuple(f'{label}=""'.encode() for label in (_RUNNING_LABEL, _WAITING_LABEL))
MODEL_LABEL = "model_name"

_GAUGE_NAMES = (
    *WAITING,
    *RUNNING,
    *KV_USAGE,
    CACHE_CONFIG,
    *CACHE_HITS,
    *CACHE_QUERIES,
    LORA_INFO,
)
SAMPLE_NAMES = frozenset(
    [*_GAUGE_NAMES, *(f"{h}{suffix}" for h in (*TTFT, *ITL) for suffix in ("_sum", "_count"))]
)
# A line is a candidate when its first _KEY_LEN bytes start a wanted name: one slice and
# one set lookup per line, which rejects all but the wanted families' buckets.
_KEY_LEN = min(map(len, SAMPLE_NAMES))
_KEYS = frozenset(name.encode()[:_KEY_LEN] for name in SAMPLE_NAMES)
_NAMES = frozenset(name.encode() for name in SAMPLE_NAMES)

MAX_CACHED_SERIES = 4096  # ~20 series per pod page: thousands of distinct pages


class Sample(NamedTuple):
    name: str
    labels: Mapping[str, str]
    value: float


class HistogramTotals(NamedTuple):
    sum: float
    num_observed: float


@dataclass(frozen=True, slots=True)
class Reading:
    """One page's values, before latency deltas."""

    waiting: int
    running: int
    kv_usage: float
    ttft: HistogramTotals | None
    itl: HistogramTotals | None
    kv_capacity_tokens: int | None = None
    cache_hits: float | None = None  # the engine's counters, as on the page
    cache_queries: float | None = None


class PageParser:
    """Parses the wanted lines of ``/metrics`` pages; caches each series' name and labels.

    Not thread-safe: one parser per scraper thread.
    """

    def __init__(self, max_cached_series: int = MAX_CACHED_SERIES) -> None:
        self.max_cached_series = max_cached_series
        self._series: dict[bytes, tuple[str, Mapping[str, str]]] = {}

    def samples(self, page: bytes) -> list[Sample]:
        """The page's samples of the series this module reads.

        Raises:
            ValueError: a wanted line is malformed.
        """
        out: list[Sample] = []
        for line in select_lines(page):
            series, value = _split_sample(line)
            parsed = self._series.get(series)
            if parsed is None:
                parsed = self._parse_series(series)
            out.append(Sample(parsed[0], parsed[1], float(value)))
        return out

    def _parse_series(self, series: bytes) -> tuple[str, Mapping[str, str]]:
        families = list(text_string_to_metric_families(series.decode() + " 0\n"))
        if len(families) != 1 or len(families[0].samples) != 1:
            raise ValueError(f"not one sample: {series[:200]!r}")
        sample = families[0].samples[0]
        if len(self._series) >= self.max_cached_series:
            self._series.clear()
        parsed = self._series[series] = (sample.name, sample.labels)
        return parsed


def select_lines(page: bytes) -> list[bytes]:
    """The sample lines of the wanted series (comments and other series dropped); of
    ``vllm:lora_requests_info`` only the current series' (module doc).

    Raises:
        ValueError: a ``vllm:lora_requests_info`` line without a number.
    """
    candidates = [line for line in page.split(b"\n") if line[:_KEY_LEN] in _KEYS]
    out: list[bytes] = []
    lora: list[bytes] = []
    for line in candidates:
        end = line.find(b"{")
        if end < 0:
            end = line.find(b" ")
        if end > 0 and line[:end] in _NAMES:
            (lora if line[:end] == _LORA_KEY else out).append(line)
    if lora:
        out.append(max(lora, key=_lora_recency))
    return out


def _split_sample(line: bytes) -> tuple[bytes, bytes]:
    """A sample line's series (name and labels) and value, as text.

    Raises:
        ValueError: the line has no value.
    """
    brace = line.rfind(b"}")
    split_at = brace + 1 if brace >= 0 else line.find(b" ")
    rest = line[split_at:].split()
    if not rest:
        raise ValueError(f"no value in {line[:200]!r}")
    return line[:split_at], rest[0]


def _lora_recency(line: bytes) -> tuple[bool, float]:
    """Series naming an adapter first, then the latest: read from the line's bytes, as
    a long-lived vLLM lists many series and only the current one is parsed."""
    value = float(_split_sample(line)[1])
    return _names_adapters(line), value if math.isfinite(value) else -math.inf


def _names_adapters(line: bytes) -> bool:
    """Whether either adapters label is not ``""`` (as GIE tests it)."""
    return not all(label in line for label in _NO_ADAPTERS)


def read_samples(samples: Sequence[Sample], models: frozenset[str]) -> Reading | None:
    """Sum (or average) the samples per quantity; ``None`` when the page has none."""
    capacity = kv_capacity_tokens([s for s in samples if s.name == CACHE_CONFIG])
    if any(s.labels.get(MODEL_LABEL) in models for s in samples):
        samples = [s for s in samples if s.labels.get(MODEL_LABEL, "") in models]
    by_name: dict[str, list[float]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s.value)
    waiting, running, kv = (_first(by_name, names) for names in (WAITING, RUNNING, KV_USAGE))
    ttft, itl = _histogram(by_name, TTFT), _histogram(by_name, ITL)
    if waiting is None and running is None and kv is None and ttft is None and itl is None:
        return None
    hits, queries = _cache_counters(by_name)
    return Reading(
        waiting=_count(waiting),
        running=_count(running),
        kv_usage=_usage(kv),
        ttft=ttft,
        itl=itl,
        kv_capacity_tokens=capacity,
        cache_hits=hits,
        cache_queries=queries,
    )


def kv_capacity_tokens(info: Sequence[Sample]) -> int | None:
    """``num_gpu_blocks * block_size`` summed over ``vllm:cache_config_info`` series."""
    total = 0
    for sample in info:
        blocks = _positive_int(sample.labels.get("num_gpu_blocks"))
        size = _positive_int(sample.labels.get("block_size"))
        if blocks and size:
            total += blocks * size
    return total or None


def lora_slots(current: Sample | None) -> LoraSlots | None:
    """The slots of the current ``vllm:lora_requests_info`` series (``select_lines``
    keeps just it); ``None`` without one.

    Raises:
        ValueError: its ``max_lora`` is missing or not a count.
    """
    if current is None:
        return None
    text = current.labels.get("max_lora")
    max_lora = _positive_int(text) or (0 if text == "0" else None)
    if max_lora is None:
        raise ValueError(f"{LORA_INFO} has max_lora={text!r}, not a count")
    return LoraSlots(
        running=_adapter_names(current.labels.get(_RUNNING_LABEL, "")),
        waiting=_adapter_names(current.labels.get(_WAITING_LABEL, "")),
        max_lora=max_lora,
    )


def _adapter_names(text: str) -> frozenset[str]:
    """A comma-separated adapters label as names: stripped, empties dropped."""
    return frozenset(filter(None, map(str.strip, text.split(","))))


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else 0
    except ValueError:
        return None
    return value if value > 0 else None


def _first(by_name: Mapping[str, list[float]], names: Sequence[str]) -> list[float] | None:
    return next((by_name[n] for n in names if n in by_name), None)


def _histogram(by_name: Mapping[str, list[float]], names: Sequence[str]) -> HistogramTotals | None:
    for name in names:
        sums, counts = by_name.get(f"{name}_sum"), by_name.get(f"{name}_count")
        if sums is not None and counts is not None:
            return HistogramTotals(math.fsum(sums), math.fsum(counts))
    return None


def _cache_counters(by_name: Mapping[str, list[float]]) -> tuple[float | None, float | None]:
    """Hits and queries summed over engines, from the first name pair on the page."""
    for hits, queries in zip(CACHE_HITS, CACHE_QUERIES, strict=True):
        if hits in by_name and queries in by_name:
            return math.fsum(by_name[hits]), math.fsum(by_name[queries])
    return None, None


def _count(values: list[float] | None) -> int:
    total = math.fsum(values) if values else 0.0
    return max(0, round(total)) if math.isfinite(total) else 0


def _usage(values: list[float] | None) -> float:
    mean = math.fsum(values) / len(values) if values else 0.0
    return min(1.0, max(0.0, mean)) if math.isfinite(mean) else 0.0


class LatencyWindow:
    """Recent mean of one histogram: delta sum / delta count between two scrapes."""

    def __init__(self, hold_s: float = 10.0) -> None:
        self.hold_s = hold_s
        self._prev: HistogramTotals | None = None
        self._mean: float | None = None
        self._mean_at_s = 0.0

    def update(self, totals: HistogramTotals | None, now_s: float) -> float | None:
        """Feed one successful scrape's totals; returns the mean to publish."""
        prev, self._prev = self._prev, totals
        if totals is not None and prev is not None:
            num_new = totals.num_observed - prev.num_observed
            if num_new > 0:
                mean = (totals.sum - prev.sum) / num_new
                if math.isfinite(mean) and mean >= 0:
                    self._mean, self._mean_at_s = mean, now_s
                    return mean
        if self._mean is not None and now_s - self._mean_at_s <= self.hold_s:
            return self._mean
        self._mean = None
        return None


class CounterSince:
    """A counter's increase since the first scrape that showed it (Prometheus'
    ``increase``): a value below the last one (the engine restarted) counts from 0."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._total = 0.0

    def update(self, value: float | None) -> float | None:
        """Feed one scrape's value; ``None`` (not on the page) while it is absent."""
        if value is None or not math.isfinite(value):
            return None
        if self._last is not None:
            self._total += value - self._last if value >= self._last else value
        self._last = value
        return self._total


class PodReader:
    """One pod's page -> ``PodMetrics``, keeping the latency windows between scrapes."""

    def __init__(self, models: frozenset[str], hold_s: float = 10.0, pod: str = "") -> None:
        """``pod`` names the pod in the log line about a malformed LoRA series."""
        self.models = models
        self.pod = pod
        self._lora_warned = False
        self._ttft = LatencyWindow(hold_s)
        self._itl = LatencyWindow(hold_s)
        self._hits = CounterSince()
        self._queries = CounterSince()

    def read(self, samples: Sequence[Sample], now_s: float) -> PodMetrics | None:
        """``None`` when the page carries none of the series we read."""
        reading = read_samples(samples, self.models)
        if reading is None:
            return None
        return PodMetrics(
            waiting=reading.waiting,
            running=reading.running,
            kv_usage=reading.kv_usage,
            ttft_s=self._ttft.update(reading.ttft, now_s),
            itl_s=self._itl.update(reading.itl, now_s),
            kv_capacity_tokens=reading.kv_capacity_tokens,
            prefix_cache_hits=self._hits.update(reading.cache_hits),
            prefix_cache_queries=self._queries.update(reading.cache_queries),
            lora=self._lora(next((s for s in samples if s.name == LORA_INFO), None)),
        )

    def _lora(self, current: Sample | None) -> LoraSlots | None:
        """``lora_slots``, or ``None`` for a malformed series, logged once."""
        try:
            return lora_slots(current)
        except ValueError as exc:
            if not self._lora_warned:
                self._lora_warned = True
                log.warning("%s: %s; read as no LoRA metric", self.pod or "a pod", exc)
            return None
