"""precise-prefix-cache's own metrics move when their event happens: tokenizing time and
the segment memo, the best pod's match ratio, the approximate view's entries and
evictions, the requests credited as arriving. A small word-level tokenizer with a ChatML template (testkit.factories) stands in
for a model's; the fallback reasons are in test_precise_prefix_cache.py."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.datalayer.kv_events import EventsSettings, KvEventsSubscriber
from extproc.pods import Pod, PodId
from extproc.request.parse import parse_request
from extproc.scheduling.interfaces import Cycle, PluginContext
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from testkit.factories import write_tokenizer
from tools.docs_reference import REFERENCE

BS = 4
PODS = [Pod(PodId("default", f"p{i}"), f"10.0.0.{i}:8000", frozenset({"m"})) for i in range(2)]
SYSTEM = "hello world " * 10


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def plugin(tmp_path: Path, registry: CollectorRegistry) -> PrecisePrefixCache:
    raw = {"models": {"m": str(write_tokenizer(tmp_path / "m"))}, "blockSize": BS,
           "maxHashCacheSize": 3, "blockSizeToHash": 16}  # fmt: skip
    return PrecisePrefixCache.from_args(raw, PluginContext(registry))


def chat(question: str) -> Cycle:
    body = {"model": "m", "messages": [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": question}]}  # fmt: skip
    return Cycle(parse_request("/v1/chat/completions", orjson.dumps(body)))


def get(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_tokenizing_is_timed_once_a_request_and_the_memo_counted(
    plugin: PrecisePrefixCache, registry: CollectorRegistry
) -> None:
    first = chat("hello")
    plugin.score(first, PODS)
    plugin.matched_tokens(first, PODS)  # the cost model's call reuses the cycle's tokens
    assert get(registry, "extproc_precise_prefix_tokenize_seconds_count", model="m") == 1
    assert get(registry, "extproc_precise_prefix_tokenize_seconds_sum", model="m") > 0
    # <|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n
    # <|im_start|>assistant\n: 5 segments between the markers, 4 distinct ("\n" twice):
    # each distinct new one is tokenized once, the repeat counts as found
    segments = "extproc_precise_prefix_segments_total"
    assert get(registry, segments, model="m", result="miss") == 4
    assert get(registry, segments, model="m", result="hit") == 1
    plugin.score(chat("world"), PODS)  # the same conversation start: only the question is new
    assert get(registry, segments, model="m", result="miss") == 5
    assert get(registry, segments, model="m", result="hit") == 5
    memo = get(registry, "extproc_precise_prefix_memo_tokens", model="m")
    assert memo == plugin.tokenizers["m"].memo_size > 0
    assert get(registry, "extproc_precise_prefix_tokenize_seconds_count", model="m") == 2


def test_the_best_pods_match_ratio_is_observed_each_time_it_scores(
    plugin: PrecisePrefixCache, registry: CollectorRegistry
) -> None:
    c = chat("hello")
    tokens = plugin.prompt_tokens(c)
    assert tokens is not None
    num_blocks = len(tokens) // BS
    half = num_blocks // 2
    plugin.index.stored(PODS[1].id, list(range(half)), None, tokens[: half * BS].tolist(), BS, None)
    plugin.score(c, PODS)
    plugin.score(chat("a question no pod has seen"), [PODS[0]])  # a miss
    ratio = "extproc_precise_prefix_cache_match_ratio"
    assert get(registry, f"{ratio}_count", model="m") == 2
    assert get(registry, f"{ratio}_sum", model="m") == pytest.approx(half / num_blocks)
    assert get(registry, f"{ratio}_bucket", model="m", le="0.0") == 1


def test_the_approximate_views_entries_and_evictions(
    plugin: PrecisePrefixCache, registry: CollectorRegistry
) -> None:
    c = Cycle(parse_request("/v1/completions", orjson.dumps({"model": "m", "prompt": "x" * 80})))
    plugin.record(c, PODS[0].id)  # 5 blocks of 16 bytes into a list of 3
    assert get(registry, "extproc_precise_prefix_cache_entries") == 3
    assert get(registry, "extproc_precise_prefix_cache_evictions_total", model="m") == 2


def test_the_arriving_requests_are_those_picked_and_not_ended(
    plugin: PrecisePrefixCache, registry: CollectorRegistry
) -> None:
    first, second = chat("hello"), chat("world")
    plugin.arriving(first, PODS[0].id)
    plugin.arriving(second, PODS[1].id)
    assert get(registry, "extproc_precise_prefix_arriving_requests") == 2
    plugin.settled(first, PODS[0].id)
    assert get(registry, "extproc_precise_prefix_arriving_requests") == 1
    plugin.pods_changed([PODS[0]])  # the other pod left
    assert get(registry, "extproc_precise_prefix_arriving_requests") == 0


def test_every_precise_metric_is_in_the_metrics_reference(
    plugin: PrecisePrefixCache, registry: CollectorRegistry
) -> None:
    """The metrics reference (docs/reference/metrics.md) names each family the plugin and
    the subscriber export."""
    KvEventsSubscriber(plugin.index, EventsSettings(), registry)  # not started: no sockets
    reference = (REFERENCE / "metrics.md").read_text()
    names = [
        f"{family.name}_total" if family.type == "counter" else family.name
        for family in registry.collect()
    ]
    assert len(names) == 24
    assert [name for name in names if f"`{name}`" not in reference] == []
