"""ModelRewriteWatcher against the fake API server: list, watch, the pool's objects only,
oldest first, malformed objects left out, a missing CRD."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from extproc.datalayer.model_rewrites import ModelRewriteWatcher, Published, WatchedRewrite
from tests.datalayer import crd_watching
from tests.datalayer.crd_watching import Recorder
from tests.datalayer.fake_kube import FakeKube

REWRITES = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/ns/inferencemodelrewrites"


def rewrite(name: str, target: str, created: str, pool: str | None = "pool") -> dict[str, Any]:
    spec: dict[str, Any] = {"rules": [{"targets": [{"modelRewrite": target}]}]}
    if pool is not None:
        spec["poolRef"] = {"name": pool}
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceModelRewrite",
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created},
        "spec": spec,
    }


def watched(*pairs: tuple[str, str]) -> tuple[WatchedRewrite, ...]:
    return tuple(
        WatchedRewrite(f"InferenceModelRewrite ns/{name}", [{"targets": [{"modelRewrite": t}]}])
        for name, t in pairs
    )


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake


@contextmanager
def watching(kube: FakeKube) -> Iterator[Recorder[Published]]:
    with crd_watching.watching(kube, ModelRewriteWatcher, pool="pool") as (_, seen):
        yield seen


def test_the_pools_rewrites_oldest_first_then_followed(kube: FakeKube) -> None:
    kube.put(REWRITES, rewrite("newer", "b", "2026-02-01T00:00:00Z"))
    kube.put(REWRITES, rewrite("older", "a", "2026-01-01T00:00:00Z"))
    kube.put(REWRITES, rewrite("theirs", "c", "2025-01-01T00:00:00Z", pool="other"))
    with watching(kube) as seen:
        assert seen.calls == [watched(("older", "a"), ("newer", "b"))]
        kube.wait_for_watches(1)
        kube.put(REWRITES, rewrite("theirs", "c", "2025-01-01T00:00:00Z"))  # moves here
        seen.wait(watched(("theirs", "c"), ("older", "a"), ("newer", "b")))
        kube.delete(REWRITES, "older")
        seen.wait(watched(("theirs", "c"), ("newer", "b")))


def test_an_object_without_a_pool_is_left_out_with_one_warning(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    kube.put(REWRITES, rewrite("ok", "a", "2026-01-01T00:00:00Z"))
    kube.put(REWRITES, rewrite("poolless", "b", "2026-01-01T00:00:00Z", pool=None))
    with caplog.at_level(logging.WARNING, "extproc.datalayer"), watching(kube) as seen:
        assert seen.calls == [watched(("ok", "a"))]
        kube.wait_for_watches(1)
        kube.put(REWRITES, rewrite("later", "c", "2026-03-01T00:00:00Z"))
        seen.wait(watched(("ok", "a"), ("later", "c")))
    assert caplog.text.count("InferenceModelRewrite ns/poolless: spec.poolRef needs a name") == 1


def test_a_missing_crd_is_no_rules_until_it_appears(kube: FakeKube) -> None:
    kube.put(REWRITES, rewrite("a", "x", "2026-01-01T00:00:00Z"))
    kube.fail_next(404, 404, 404)
    with watching(kube) as seen:
        assert seen.calls == [()]
        seen.wait(watched(("a", "x")))
