"""PodStore: merging discovery with scraped metrics, readiness, cheap publishing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from extproc.datalayer.store import MetricsUpdate, PodStore
from extproc.pods import Pod, PodMetrics
from testkit.factories import make_pod
from testkit.pod_store import set_metrics


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class Published:
    def __init__(self) -> None:
        self.snapshots: list[tuple[Pod, ...]] = []

    def __call__(self, pods: tuple[Pod, ...]) -> None:
        self.snapshots.append(pods)

    @property
    def last(self) -> tuple[Pod, ...]:
        return self.snapshots[-1]

    def ready(self) -> list[str]:
        return [p.id.name for p in self.last if p.ready]


def make_store(
    stale_after_s: float | None = 2.0, grace_s: float | None = None
) -> tuple[PodStore, Published, Clock]:
    published, clock = Published(), Clock()
    store = PodStore(published, stale_after_s=stale_after_s, grace_s=grace_s, clock=clock)
    return store, published, clock


LOADED = PodMetrics(waiting=2, running=3, kv_usage=0.5, ttft_s=0.1, itl_s=0.01)


def test_merges_discovery_and_metrics_in_discovery_order() -> None:
    store, published, _ = make_store()
    a, b = make_pod("a", port=1), make_pod("b", port=2)
    store.set_pods([b, a])
    set_metrics(store, a.id, LOADED)
    assert [p.id.name for p in published.last] == ["b", "a"]
    assert published.last[1].metrics == LOADED and published.last[1].ready
    assert published.last[0].metrics == PodMetrics()
    assert published.last[1].address == a.address and published.last[1].models == a.models


def test_grace_before_first_scrape_then_stale() -> None:
    store, published, clock = make_store(stale_after_s=2.0, grace_s=5.0)
    store.set_pods([make_pod("a")])
    assert published.ready() == ["a"]
    clock.now_s += 5.0
    store.update_metrics([])
    assert published.ready() == ["a"]
    clock.now_s += 0.1
    store.update_metrics([])
    assert published.ready() == []


def test_fresh_metrics_then_stale_then_back() -> None:
    store, published, clock = make_store(stale_after_s=2.0)
    a = make_pod("a")
    store.set_pods([a])
    set_metrics(store, a.id, LOADED)
    clock.now_s += 1.5
    set_metrics(store, a.id, None)  # a failed scrape keeps the last metrics
    assert published.ready() == ["a"] and published.last[0].metrics == LOADED
    clock.now_s += 0.6  # 2.1 s since the last success
    store.update_metrics([])
    assert published.ready() == [] and published.last[0].metrics == LOADED
    set_metrics(store, a.id, PodMetrics(waiting=1))
    assert published.ready() == ["a"] and published.last[0].metrics.waiting == 1


def test_unreachable_is_not_ready_at_once_until_a_scrape_succeeds() -> None:
    store, published, _ = make_store()
    a = make_pod("a")
    store.set_pods([a])
    set_metrics(store, a.id, LOADED)
    set_metrics(store, a.id, None, reachable=False)
    assert published.ready() == []
    set_metrics(store, a.id, None)  # e.g. a timeout: still out
    assert published.ready() == []
    set_metrics(store, a.id, LOADED)
    assert published.ready() == ["a"]


def test_discovery_unready_wins_over_fresh_metrics() -> None:
    store, published, _ = make_store()
    a = make_pod("a", ready=False)
    store.set_pods([a])
    set_metrics(store, a.id, LOADED)
    assert published.ready() == []


def test_unchanged_pods_keep_their_objects_and_nothing_is_republished() -> None:
    store, published, clock = make_store()
    a, b = make_pod("a", port=1), make_pod("b", port=2)
    store.set_pods([a, b])
    store.update_metrics([MetricsUpdate(a.id, LOADED), MetricsUpdate(b.id, LOADED)])
    first = published.last
    count = len(published.snapshots)
    clock.now_s += 0.2
    store.update_metrics([MetricsUpdate(a.id, replace(LOADED)), MetricsUpdate(b.id, LOADED)])
    store.set_pods([make_pod("a", port=1), make_pod("b", port=2)])  # equal, new objects
    assert len(published.snapshots) == count
    set_metrics(store, b.id, PodMetrics(waiting=9))
    assert published.last[0] is first[0] and published.last[1] is not first[1]


def test_one_publish_per_batch() -> None:
    store, published, _ = make_store()
    pods = [make_pod(f"p{i}", port=i + 1) for i in range(4)]
    store.set_pods(pods)
    before = len(published.snapshots)
    store.update_metrics([MetricsUpdate(p.id, LOADED) for p in pods])
    assert len(published.snapshots) == before + 1


def test_removed_pods_leave_and_their_late_updates_are_ignored() -> None:
    store, published, _ = make_store()
    a, b = make_pod("a", port=1), make_pod("b", port=2)
    store.set_pods([a, b])
    store.set_pods([b])
    set_metrics(store, a.id, LOADED)
    assert [p.id.name for p in published.last] == ["b"]
    store.set_pods([a, b])  # back: a new pod, in its grace period, without old metrics
    assert published.last[0].metrics == PodMetrics() and published.ready() == ["a", "b"]


def test_without_staleness_readiness_is_discoverys() -> None:
    store, published, clock = make_store(stale_after_s=None)
    store.set_pods([make_pod("a", port=1), make_pod("b", port=2, ready=False)])
    clock.now_s += 3600
    store.update_metrics([])
    assert published.ready() == ["a"]


def test_rejects_non_positive_staleness() -> None:
    with pytest.raises(ValueError, match="stale_after_s"):
        PodStore(lambda pods: None, stale_after_s=0)


def test_scrape_ages_count_from_the_last_successful_scrape() -> None:
    store, _, clock = make_store(stale_after_s=2.0)
    a, b = make_pod("a"), make_pod("b")
    store.set_pods([a, b])
    set_metrics(store, a.id, LOADED)
    clock.now_s += 1.5
    set_metrics(store, a.id, None)  # failed: the age still runs from the success
    assert store.scrape_ages() == {a.id: 1.5, b.id: None}
