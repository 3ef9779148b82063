"""PodStore: the adapters read from each pod's /v1/models, merged into the published pods
and seen by the scheduler's pod table."""

from __future__ import annotations

from dataclasses import replace

import pytest

from extproc.datalayer.store import AdaptersUpdate, MetricsUpdate, PodStore
from extproc.errors import ModelNotFound
from extproc.pods import Pod, PodMetrics
from extproc.scheduling.podtable import PodTable
from testkit.factories import make_pod

BASE = "base"


class Published(list[tuple[Pod, ...]]):
    def __call__(self, pods: tuple[Pod, ...]) -> None:
        self.append(pods)


def make_store(*pods: Pod) -> tuple[PodStore, Published]:
    published = Published()
    store = PodStore(published, stale_after_s=2.0, clock=lambda: 100.0)
    store.set_pods(pods)
    return store, published


def found(store: PodStore, pod: Pod, *adapters: str) -> None:
    store.update_metrics([], [AdaptersUpdate(pod.id, frozenset(adapters))])


def test_adapters_found_are_added_to_the_pods_models_and_adapters() -> None:
    a, b = make_pod("a", model=BASE, port=1), make_pod("b", model=BASE, port=2)
    store, published = make_store(a, b)
    found(store, a, "sql", "chat")
    pod_a, pod_b = published[-1]
    assert pod_a.models == {BASE, "sql", "chat"} and pod_a.adapters == {"sql", "chat"}
    assert pod_b.models == {BASE} and pod_b.adapters == frozenset()


def test_the_sources_own_adapters_stay_when_the_page_does_not_list_them() -> None:
    a = replace(make_pod("a", model=BASE), models=frozenset({BASE, "pinned"}))
    a = replace(a, adapters=frozenset({"pinned"}))
    store, published = make_store(a)
    found(store, a, "loaded")
    assert published[-1][0].models == {BASE, "pinned", "loaded"}
    assert published[-1][0].adapters == {"pinned", "loaded"}
    found(store, a)
    assert published[-1][0].models == {BASE, "pinned"}
    assert published[-1][0].adapters == {"pinned"}


def test_adapters_appearing_and_disappearing_rebuild_the_pod_table() -> None:
    """The table's rows-only memory is keyed on each row's models: a loaded adapter
    becomes routable, an unloaded one is no model any more."""
    a = make_pod("a", model=BASE)
    store, published = make_store(a)
    table = PodTable(published[-1])
    with pytest.raises(ModelNotFound):
        table.candidates("sql")
    table.candidates(BASE)
    found(store, a, "sql")
    table = PodTable(published[-1], previous=table)
    assert table.candidates("sql").all.tolist() == [0]
    found(store, a)
    table = PodTable(published[-1], previous=table)
    with pytest.raises(ModelNotFound):
        table.candidates("sql")


def test_an_unchanged_list_publishes_nothing_and_keeps_the_pod_object() -> None:
    a = make_pod("a", model=BASE)
    store, published = make_store(a)
    found(store, a, "sql")
    pod, count = published[-1][0], len(published)
    found(store, a, "sql")
    store.update_metrics([])
    assert len(published) == count and published[-1][0] is pod


def test_metrics_and_adapters_of_one_tick_are_one_publish() -> None:
    a = make_pod("a", model=BASE)
    store, published = make_store(a)
    count = len(published)
    metrics = PodMetrics(waiting=3)
    store.update_metrics([MetricsUpdate(a.id, metrics)], [AdaptersUpdate(a.id, frozenset({"x"}))])
    assert len(published) == count + 1
    assert published[-1][0].metrics == metrics and published[-1][0].adapters == {"x"}
    found(store, a)  # adapters gone, the metrics kept
    assert published[-1][0].metrics == metrics and published[-1][0].models == {BASE}


def test_a_pod_that_leaves_forgets_its_adapters() -> None:
    a, b = make_pod("a", model=BASE, port=1), make_pod("b", model=BASE, port=2)
    store, published = make_store(a, b)
    found(store, a, "sql")
    store.set_pods([b])
    found(store, a, "late")  # a read finished after the pod left: ignored
    store.set_pods([a, b])
    assert published[-1][0].models == {BASE} and published[-1][0].adapters == frozenset()


def test_without_adapters_found_the_published_pod_equals_the_base() -> None:
    """Pods whose pages list no adapter are published exactly as before."""
    a = make_pod("a", model=BASE)
    store, published = make_store(a)
    found(store, a)
    assert published[-1][0] == replace(a, ready=True)
