"""The scheduler: candidates, filters, weighted sums, ranking, errors, verbose logs."""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import ClassVar

import pytest
from prometheus_client import CollectorRegistry

from extproc.errors import ModelNotFound, NoCapacity, NoReadyPods
from extproc.pods import Pod, PodId
from extproc.scheduling.interfaces import Cycle, Preparation
from extproc.scheduling.scheduler import Scheduler, WeightedScorer
from testkit.factories import PREFIX_ONLY, make_cycle, make_pod, make_scheduler


class FixedScorer:
    type_name: ClassVar[str] = "fixed"

    def __init__(self, scores: dict[str, int]) -> None:
        self.scores = scores

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        return {p.id: self.scores[p.id.name] for p in pods if p.id.name in self.scores}


class DropFilter:
    type_name: ClassVar[str] = "drop"

    def __init__(self, drop: set[str]) -> None:
        self.drop = drop

    def filter(self, cycle: Cycle, pods: Sequence[Pod]) -> Sequence[Pod]:
        return [p for p in pods if p.id.name not in self.drop]


def names(pods: Sequence[Pod]) -> list[str]:
    return [p.id.name for p in pods]


def test_weighted_sum_orders_best_first() -> None:
    sched = Scheduler(
        scorers=(
            WeightedScorer(FixedScorer({"a": 100, "b": 0, "c": 50}), 1),
            WeightedScorer(FixedScorer({"a": 0, "b": 60, "c": 40}), 2),
        )
    )
    ranked = sched.schedule(make_cycle("p"), [make_pod("a"), make_pod("b"), make_pod("c")])
    assert names(ranked) == ["c", "b", "a"]  # 130, 120, 100


def test_filters_run_before_scores_and_an_empty_result_is_429() -> None:
    sched = Scheduler(
        filters=(DropFilter({"a"}),), scorers=(WeightedScorer(FixedScorer({"a": 100}), 1),)
    )
    assert names(sched.schedule(make_cycle("p"), [make_pod("a"), make_pod("b")])) == ["b"]
    with pytest.raises(NoCapacity, match="filter 'drop' removed every pod") as info:
        Scheduler(filters=(DropFilter({"a", "b"}),)).schedule(
            make_cycle("p"), [make_pod("a"), make_pod("b")]
        )
    assert info.value.http_status == 429


def test_only_ready_pods_of_the_model_are_candidates() -> None:
    pods = [make_pod("a", model="other"), make_pod("b", ready=False), make_pod("c")]
    assert names(Scheduler().schedule(make_cycle("p"), pods)) == ["c"]


def test_unknown_model_is_404_and_no_ready_pod_is_503() -> None:
    with pytest.raises(ModelNotFound) as info:
        Scheduler().schedule(make_cycle("p", model="nope"), [make_pod("a")])
    assert info.value.http_status == 404 and "'nope'" in info.value.message
    with pytest.raises(NoReadyPods) as info2:
        Scheduler().schedule(make_cycle("p"), [make_pod("a", ready=False)])
    assert info2.value.http_status == 503


def test_ties_are_broken_randomly_so_equal_pods_share_load() -> None:
    sched = Scheduler(rng=random.Random(7))
    pods = [make_pod(n) for n in "abcd"]
    firsts = Counter(sched.schedule(make_cycle("p"), pods)[0].id.name for _ in range(400))
    assert set(firsts) == set("abcd") and min(firsts.values()) > 60


def test_prefix_cache_end_to_end_second_request_goes_to_the_first_pod() -> None:
    sched = make_scheduler(PREFIX_ONLY)
    pods = [make_pod(n) for n in "abcd"]
    first = sched.schedule(make_cycle("system prompt " * 50 + "question 1"), pods)[0]
    sched.record(make_cycle("system prompt " * 50 + "question 1"), first.id)
    for _ in range(20):
        assert sched.schedule(make_cycle("system prompt " * 50 + "question 2"), pods)[0] == first


class ReversingFilter:
    """A plain filter that hands its pods back in another order."""

    type_name: ClassVar[str] = "reverse"

    def filter(self, cycle: Cycle, pods: Sequence[Pod]) -> Sequence[Pod]:
        return list(reversed(pods))


def test_a_plain_filter_returning_pods_in_any_order_leaves_scores_on_their_pods() -> None:
    sched = make_scheduler(PREFIX_ONLY)
    sched.filters = (ReversingFilter(),)
    pods = [make_pod(n) for n in "abcdef"]
    prompt = "system prompt " * 50
    for name, length in (("e", 400), ("b", 200)):  # e holds more of the prompt than b
        sched.record(make_cycle(prompt[:length]), PodId("default", name))
    ranked = sched.schedule(make_cycle(prompt), pods)
    assert names(ranked)[:2] == ["e", "b"]


def test_verbose_logging_prints_kthena_lines(caplog: pytest.LogCaptureFixture) -> None:
    """Kthena's RunScorePlugins at --v=4: each plugin's scores, then the weighted totals."""
    sched = make_scheduler(PREFIX_ONLY.replace("weight: 1", "weight: 2"))
    pods = [make_pod("my-model-0"), make_pod("my-model-1")]
    sched.record(make_cycle("hello " * 30), pods[0].id)
    with caplog.at_level(logging.DEBUG, logger="extproc.scheduling"):
        sched.schedule(make_cycle("hello " * 30), pods)
    assert caplog.messages == [
        "ScorePlugin: prefix-cache",
        "Pod: default/my-model-0, Score: 100",
        "Pod: default/my-model-1, Score: 0",
        "Final Pod Scores:",
        "  Pod: default/my-model-0, Final Score: 200",
        "  Pod: default/my-model-1, Final Score: 0",
    ]


def test_no_score_logging_at_default_level(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="extproc.scheduling"):
        make_scheduler(PREFIX_ONLY).schedule(make_cycle("x"), [make_pod("a")])
    assert not [r for r in caplog.records if r.name == "extproc.scheduling"]


def test_pods_changed_reaches_listeners() -> None:
    sched = make_scheduler(PREFIX_ONLY)
    a, b = make_pod("a"), make_pod("b")
    sched.record(make_cycle("x" * 100), a.id)
    plugin = sched.scorers[0].scorer
    assert plugin.index.num_entries > 0  # type: ignore[attr-defined]
    sched.pods_changed([b])
    assert plugin.index.num_entries == 0  # type: ignore[attr-defined]  # a left the index


def test_each_plugin_call_is_timed() -> None:
    registry = CollectorRegistry()
    sched = make_scheduler(PREFIX_ONLY, registry)
    for _ in range(3):
        sched.schedule(make_cycle("timed " * 20), [make_pod("a"), make_pod("b")])
    labels = {"plugin": "prefix-cache", "extension_point": "score"}
    assert registry.get_sample_value("extproc_plugin_duration_seconds_count", labels) == 3
    total = registry.get_sample_value("extproc_plugin_duration_seconds_sum", labels)
    assert total is not None and total > 0


class Prepares:
    """A ``Preparer`` that has slow work, or none, and logs what was done with it."""

    def __init__(self, name: str, done: list[str], slow: bool = True) -> None:
        self.name, self.done, self.slow = name, done, slow

    def prepare(self, cycle: Cycle) -> Preparation | None:
        if not self.slow:
            return None
        return Preparation(
            run=lambda: self.done.append(f"{self.name} ran"),
            skip=lambda: self.done.append(f"{self.name} skipped"),
        )


def test_the_plugins_slow_work_comes_as_one_preparation() -> None:
    done: list[str] = []
    a, b, idle = Prepares("a", done), Prepares("b", done), Prepares("idle", done, slow=False)
    assert Scheduler().prepare(make_cycle("p")) is None
    assert Scheduler(preparers=(idle,)).prepare(make_cycle("p")) is None
    assert Scheduler(preparers=(idle, a)).prepare(make_cycle("p")) is not None
    both = Scheduler(preparers=(a, idle, b)).prepare(make_cycle("p"))
    assert both is not None
    both.run()
    both.skip()
    assert done == ["a ran", "b ran", "a skipped", "b skipped"]
