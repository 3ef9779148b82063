"""InferenceObjectiveWatcher against the fake API server: list, watch, pools, bad objects."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from extproc.datalayer.k8s import WatchTiming
from extproc.datalayer.objectives import (
    InferenceObjectiveWatcher,
    MalformedObjective,
    objective_priority,
)
from extproc.errors import ConfigError
from testkit.waiting import wait_until
from tests.datalayer.crd_watching import FAST, server_config, watching
from tests.datalayer.fake_kube import FakeKube, inference_objective

OBJECTIVES = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/ns/inferenceobjectives"


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake


def test_start_lists_then_follows_changes(kube: FakeKube) -> None:
    kube.put(OBJECTIVES, inference_objective("critical", 100))
    kube.put(OBJECTIVES, inference_objective("unset"))  # no priority: 0
    with watching(kube, InferenceObjectiveWatcher, pool="pool") as (watcher, published):
        assert published.calls == [{"critical": 100, "unset": 0}]
        assert watcher.published == {"critical": 100, "unset": 0}
        assert kube.requests_of("list")[0].path == OBJECTIVES
        kube.wait_for_watches(1)
        kube.put(OBJECTIVES, inference_objective("sheddable", -1))
        published.wait({"critical": 100, "unset": 0, "sheddable": -1})
        kube.put(OBJECTIVES, inference_objective("critical", 50))  # a priority change
        published.wait({"critical": 50, "unset": 0, "sheddable": -1})
        kube.delete(OBJECTIVES, "unset")
        published.wait({"critical": 50, "sheddable": -1})
        assert len(kube.requests_of("list")) == 1


def test_only_the_pools_objectives_count(kube: FakeKube) -> None:
    kube.put(OBJECTIVES, inference_objective("mine", 10))
    kube.put(OBJECTIVES, inference_objective("theirs", 20, pool="other"))
    several = inference_objective("several", 30, pool=None)
    several["spec"]["poolRefs"] = [{"name": "other"}, {"name": "pool"}]
    kube.put(OBJECTIVES, several)
    with watching(kube, InferenceObjectiveWatcher, pool="pool") as (_, published):
        assert published.calls == [{"mine": 10, "several": 30}]
        kube.wait_for_watches(1)
        kube.put(OBJECTIVES, inference_objective("mine", 10, pool="other"))  # moves away
        published.wait({"several": 30})
        kube.put(OBJECTIVES, inference_objective("theirs", 20))  # moves here
        published.wait({"several": 30, "theirs": 20})
    with watching(kube, InferenceObjectiveWatcher) as (watcher, _):  # no pool: the whole namespace
        assert watcher.published == {"mine": 10, "several": 30, "theirs": 20}


def test_a_malformed_objective_is_skipped_with_one_warning(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    kube.put(OBJECTIVES, inference_objective("ok", 1))
    kube.put(OBJECTIVES, inference_objective("word", "high"))
    kube.put(OBJECTIVES, inference_objective("fraction", 1.5))
    with (
        caplog.at_level(logging.WARNING, "extproc.datalayer"),
        watching(kube, InferenceObjectiveWatcher, pool="pool") as (
            _,
            published,
        ),
    ):
        assert published.calls == [{"ok": 1}]
        kube.wait_for_watches(1)
        kube.put(OBJECTIVES, inference_objective("flag", True))
        kube.put(OBJECTIVES, inference_objective("later", 2))
        published.wait({"ok": 1, "later": 2})
        kube.pause_watches(True)  # missed, and compacted away: a 410 and a re-list
        kube.put(OBJECTIVES, inference_objective("word", "high"))  # touched, still bad
        kube.compact()
        kube.pause_watches(False)
        kube.drop_watches()
        wait_until(lambda: len(kube.requests_of("list")) == 2)
        kube.put(OBJECTIVES, inference_objective("word", 7))  # fixed
        published.wait({"ok": 1, "later": 2, "word": 7})
    assert caplog.text.count("InferenceObjective ns/word: spec.priority must be an integer") == 1
    assert caplog.text.count("ns/fraction: spec.priority must be an integer, got 1.5") == 1
    assert caplog.text.count("ns/flag: spec.priority must be an integer, got True") == 1


@pytest.mark.parametrize(
    ("obj", "problem"),
    [
        pytest.param({"metadata": {}, "spec": {"priority": 1}}, "no metadata.name", id="no-name"),
        pytest.param(
            {"metadata": {"name": "x"}, "spec": {"poolRef": {"kind": "InferencePool"}}},
            "a pool reference needs a name",
            id="nameless-pool-ref",
        ),
        pytest.param(
            {"metadata": {"name": "x"}, "spec": {"poolSelector": {"matchLabels": {"a": "b"}}}},
            "spec.poolSelector is not supported",
            id="pool-selector",
        ),
        pytest.param({"metadata": {"name": "x"}, "spec": "high"}, "spec must be", id="bad-spec"),
    ],
)
def test_malformed_objects(obj: dict[str, Any], problem: str) -> None:
    with pytest.raises(MalformedObjective, match=problem):
        objective_priority(obj, "pool")


def test_an_objective_of_another_pool_is_not_checked() -> None:
    other = inference_objective("x", "high", pool="other")
    assert objective_priority(other, "pool") is None
    other["spec"]["poolRef"] = {"kind": "SomethingElse", "name": "pool"}
    assert objective_priority(other, "pool") is None
    with pytest.raises(MalformedObjective, match="spec.priority"):
        objective_priority(other, None)


@pytest.mark.parametrize("abrupt", [False, True], ids=["server-ends", "dropped"])
def test_watch_resumes_after_the_server_drops_it(kube: FakeKube, abrupt: bool) -> None:
    kube.put(OBJECTIVES, inference_objective("a", 1))
    with watching(kube, InferenceObjectiveWatcher, pool="pool") as (_, published):
        kube.wait_for_watches(1)
        assert kube.drop_watches(abrupt=abrupt) == 1
        kube.put(OBJECTIVES, inference_objective("b", 2))  # during the gap or after: not lost
        published.wait({"a": 1, "b": 2})
        assert len(kube.requests_of("watch")) >= 2
        assert len(kube.requests_of("list")) == 1


def test_a_missing_crd_is_no_objectives_until_it_appears(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    kube.put(OBJECTIVES, inference_objective("a", 1))
    kube.fail_next(404, 404, 404)
    started_s = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, "extproc.datalayer"),
        watching(kube, InferenceObjectiveWatcher) as (
            _,
            published,
        ),
    ):
        assert time.monotonic() - started_s < FAST.start_timeout_s
        assert published.calls == [{}]
        published.wait({"a": 1})  # the CRD is served now
        kube.wait_for_watches(1)
        kube.put(OBJECTIVES, inference_objective("b", 2))
        published.wait({"a": 1, "b": 2})
    assert caplog.text.count("does not serve inferenceobjectives") == 1
    assert caplog.text.count("404") == 1  # the quiet re-lists log nothing


def test_start_fails_when_forbidden(kube: FakeKube) -> None:
    kube.fail_next(*[403] * 200)
    timing = WatchTiming(start_timeout_s=0.3, backoff_initial_s=0.01, backoff_max_s=0.05)
    watcher = InferenceObjectiveWatcher(
        server_config(kube.url), lambda _: None, namespace="ns", timing=timing
    )
    with pytest.raises(ConfigError, match="within 0.3 s: list InferenceObjectives in ns: 403"):
        watcher.start()


def test_another_api_version(kube: FakeKube) -> None:
    path = "/apis/example.io/v1/namespaces/ns/inferenceobjectives"
    kube.put(path, inference_objective("a", 3))
    with watching(kube, InferenceObjectiveWatcher, api="example.io/v1") as (watcher, _):
        assert watcher.published == {"a": 3}
    with pytest.raises(ConfigError, match="group/version"):
        InferenceObjectiveWatcher(server_config(kube.url), lambda _: None, namespace="ns", api="v1")
