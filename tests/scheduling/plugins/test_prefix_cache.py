"""The prefix-cache score plugin: scores, top-K, recording, metrics."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from extproc.scheduling.config import build_scheduler, parse_config
from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.plugins.cost_aware import CostAware
from extproc.scheduling.plugins.prefix_cache import PrefixCacheArgs, PrefixCacheScorer
from extproc.scheduling.podtable import PodTable
from testkit.factories import make_cycle, make_pod


def make_plugin(registry: CollectorRegistry, **args: int) -> PrefixCacheScorer:
    return PrefixCacheScorer.from_args(args, PluginContext(registry))


def sample(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    value = registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def test_spec_example_24_of_32_blocks_scores_75() -> None:
    plugin = make_plugin(CollectorRegistry())
    pods = [make_pod("a"), make_pod("b")]
    prompt = "x" * 2000
    first24 = make_cycle(prompt[: 24 * 64])
    plugin.record(first24, pods[0].id)
    scores = plugin.score(make_cycle(prompt), pods)
    assert scores == {pods[0].id: 75}  # floor(24 / 32 * 100); b is left out: 0


def test_same_prompt_scores_100_and_floor_rounding() -> None:
    plugin = make_plugin(CollectorRegistry())
    pod = make_pod("a")
    plugin.record(make_cycle("y" * 640), pod.id)  # 10 blocks
    assert plugin.score(make_cycle("y" * 640), [pod]) == {pod.id: 100}
    # 10 of 11 hashed blocks -> 90.9 -> 90
    assert plugin.score(make_cycle("y" * 640 + "z"), [pod]) == {pod.id: 90}


def test_only_top_k_pods_score() -> None:
    plugin = make_plugin(CollectorRegistry(), topKMatches=2)
    pods = [make_pod(f"p{i}") for i in range(4)]
    prompt = "q" * 640
    for i, pod in enumerate(pods):
        plugin.record(make_cycle(prompt[: (i + 1) * 128]), pod.id)
    scores = plugin.score(make_cycle(prompt), pods)
    assert scores == {pods[3].id: 80, pods[2].id: 60}


def test_empty_prompt_is_not_scored_or_observed() -> None:
    registry = CollectorRegistry()
    plugin = make_plugin(registry)
    assert plugin.score(make_cycle(""), [make_pod("a")]) == {}
    plugin.record(make_cycle(""), make_pod("a").id)
    assert plugin.index.num_entries == 0
    assert sample(registry, "kthena_router_prefix_cache_match_ratio_count", {"model": "m"}) == 0


def test_salted_requests_never_match_each_other() -> None:
    plugin = make_plugin(CollectorRegistry())
    pod = make_pod("a")
    plugin.record(make_cycle("s" * 500, salt="t1"), pod.id)
    assert plugin.score(make_cycle("s" * 500, salt="t2"), [pod]) == {}
    assert plugin.score(make_cycle("s" * 500), [pod]) == {}
    assert plugin.score(make_cycle("s" * 500, salt="t1"), [pod]) == {pod.id: 100}


def test_metrics_match_ratio_evictions_entries() -> None:
    registry = CollectorRegistry()
    plugin = make_plugin(registry, maxHashCacheSize=4)
    pod = make_pod("a")
    plugin.score(make_cycle("a" * 128), [pod])  # miss: observed as 0
    plugin.record(make_cycle("a" * 128), pod.id)  # 2 entries
    plugin.score(make_cycle("a" * 256), [pod])  # best pod matched 2 of 4: 0.5
    plugin.record(make_cycle("b" * 256), pod.id)  # 4 new entries into a list of 4
    labels = {"model": "m"}
    assert sample(registry, "kthena_router_prefix_cache_match_ratio_count", labels) == 2
    assert sample(registry, "kthena_router_prefix_cache_match_ratio_sum", labels) == 0.5
    assert (
        sample(registry, "kthena_router_prefix_cache_match_ratio_bucket", {**labels, "le": "0.0"})
        == 1
    )
    assert sample(registry, "kthena_router_prefix_cache_evictions_total", labels) == 2
    assert sample(registry, "kthena_router_prefix_cache_entries") == 4


def test_match_ratio_buckets_are_kthenas() -> None:
    registry = CollectorRegistry()
    plugin = make_plugin(registry)
    plugin.score(make_cycle("a" * 64), [make_pod("a")])
    bounds = [
        s.labels["le"]
        for metric in registry.collect()
        for s in metric.samples
        if s.name == "kthena_router_prefix_cache_match_ratio_bucket"
    ]
    assert bounds == ["0.0", "0.1", "0.25", "0.5", "0.75", "0.9", "0.95", "0.99", "1.0", "+Inf"]


def test_evictions_are_labelled_with_the_evicted_entrys_model() -> None:
    """Kthena's eviction callback counts key.model: the model whose entry was dropped,
    not the model of the request whose record made room."""
    registry = CollectorRegistry()
    plugin = make_plugin(registry, maxHashCacheSize=4)
    pod = make_pod("a", model="m")
    plugin.record(make_cycle("a" * 256, model="old"), pod.id)  # 4 entries of model old
    plugin.record(make_cycle("b" * 128, model="new"), pod.id)  # drops 2 of them
    assert sample(registry, "kthena_router_prefix_cache_evictions_total", {"model": "old"}) == 2
    assert (
        registry.get_sample_value("kthena_router_prefix_cache_evictions_total", {"model": "new"})
        is None
    )


def test_pod_removal_purges_entries_not_counted_as_evictions() -> None:
    registry = CollectorRegistry()
    plugin = make_plugin(registry)
    a, b = make_pod("a"), make_pod("b")
    plugin.record(make_cycle("z" * 300), a.id)
    plugin.record(make_cycle("z" * 300), b.id)
    plugin.pods_changed([b])
    assert sample(registry, "kthena_router_prefix_cache_entries") == 5
    assert sample(registry, "kthena_router_prefix_cache_evictions_total", {"model": "m"}) == 0
    assert plugin.score(make_cycle("z" * 300), [a, b]) == {b.id: 100}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(None, PrefixCacheArgs(), id="omitted"),
        pytest.param(
            {"blockSizeToHash": 32, "topKMatches": 2}, PrefixCacheArgs(32, 128, 50000, 2), id="some"
        ),
        pytest.param(
            {"blockSizeToHash": 0, "maxBlocksToMatch": -3}, PrefixCacheArgs(), id="zero-negative"
        ),
        pytest.param(
            {"blockSize": 32, "maxBlocksToMatch": 256},
            PrefixCacheArgs(64, 256, 50000, 5),
            id="misspelled",
        ),
        pytest.param({"blockSizeToHash": None}, PrefixCacheArgs(), id="null"),
    ],
)
def test_args_semantics(raw: object, expected: PrefixCacheArgs) -> None:
    assert make_plugin_from(raw).args == expected


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param({"blockSizeToHash": "64", "topKMatches": 2}, id="string-value"),
        pytest.param({"maxHashCacheSize": 1.5}, id="float-value"),
        pytest.param({"topKMatches": True}, id="bool-value"),
        pytest.param(["blockSizeToHash", 64], id="list"),
        pytest.param("blockSizeToHash: 64", id="string-block"),
    ],
)
def test_unparseable_args_fall_back_to_all_defaults_and_log(
    raw: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="extproc.scheduling.config"):
        assert make_plugin_from(raw).args == PrefixCacheArgs()
    assert "Failed to unmarshal PrefixCacheArgs, using default values" in caplog.text


def make_plugin_from(raw: object) -> PrefixCacheScorer:
    return PrefixCacheScorer.from_args(raw, PluginContext(CollectorRegistry()))


def test_block_geometry_comes_from_args() -> None:
    plugin = make_plugin(CollectorRegistry(), blockSizeToHash=10, maxBlocksToMatch=3)
    pod = make_pod("a")
    plugin.record(make_cycle("k" * 30), pod.id)
    assert plugin.index.num_entries == 3
    # only the first 30 bytes are hashed: a differing tail still scores 100
    assert plugin.score(make_cycle("k" * 30 + "different"), [pod]) == {pod.id: 100}


def test_matched_bytes_covers_every_pod_and_caps_at_the_prompt() -> None:
    plugin = make_plugin(CollectorRegistry(), topKMatches=1)
    pods = [make_pod(f"p{i}", port=i + 1) for i in range(3)]
    prompt = "m" * 300  # 5 blocks, the last one 44 bytes
    plugin.record(make_cycle(prompt), pods[0].id)
    plugin.record(make_cycle(prompt[:128]), pods[1].id)
    assert plugin.matched_bytes(make_cycle(prompt), pods) == {pods[0].id: 300, pods[1].id: 128}
    assert plugin.matched_bytes(make_cycle(""), pods) == {}


def test_is_the_prefix_matcher_the_configuration_hands_to_cost_aware() -> None:
    config = parse_config(
        "scheduler: {plugins: {Score: {enabled: [{name: cost-aware, weight: 1}, "
        "{name: prefix-cache, weight: 1}]}}}",
        "test",
    )
    scheduler = build_scheduler(config, CollectorRegistry())
    cost_aware, prefix_cache = (ws.scorer for ws in scheduler.scorers)
    assert isinstance(cost_aware, CostAware) and isinstance(prefix_cache, PrefixCacheScorer)
    assert cost_aware.prefix is prefix_cache


def test_both_paths_leave_the_top_k_pods_uncached_tokens_and_score_alike() -> None:
    plugin = make_plugin(CollectorRegistry(), topKMatches=2)
    pods = [make_pod(f"p{i}", port=i + 1) for i in range(4)]
    prompt = "m" * 300  # 5 blocks, the last one 44 bytes; 75 tokens estimated
    plugin.record(make_cycle(prompt), pods[0].id)
    plugin.record(make_cycle(prompt[:128]), pods[1].id)
    plugin.record(make_cycle(prompt[:64]), pods[2].id)  # not in the top 2
    by_pods, by_table = make_cycle(prompt), make_cycle(prompt)
    scores = plugin.score(by_pods, pods)
    table = PodTable(pods)
    rows = plugin.score_table(by_table, table, np.arange(4, dtype=np.int64))
    assert scores == {pods[0].id: 100, pods[1].id: 40}
    assert rows.tolist() == [100, 40, 0, 0]
    for cycle in (by_pods, by_table):  # the whole prompt where the view has no match
        assert [cycle.num_prefill_tokens(p.id) for p in pods] == [0, 43, 75, 75]
        assert [cycle.predicted_cached_tokens(p.id) for p in pods] == [75, 32, 0, 0]


def test_a_cost_plugins_uncached_tokens_are_left_alone() -> None:
    plugin = make_plugin(CollectorRegistry())
    pod = make_pod("a")
    plugin.record(make_cycle("y" * 640), pod.id)
    cycle = make_cycle("y" * 640)
    cycle.uncached_tokens[pod.id] = 7  # a cost plugin that scored before
    plugin.score_table(cycle, PodTable([pod]), np.arange(1, dtype=np.int64))
    plugin.score(cycle, [pod])
    assert cycle.num_prefill_tokens(pod.id) == 7 and not cycle.uncached_rows
