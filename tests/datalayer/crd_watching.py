"""Shared by the tests of the custom-resource watchers (``crd_watch``'s subclasses): fast
timing, a kubeconfig for the fake API server, a recorder of what is published, and a
watcher started and stopped around a test."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.config.models import Cluster

from extproc.datalayer.crd_watch import CustomResourceWatcher
from extproc.datalayer.k8s import WatchTiming
from tests.datalayer.fake_kube import FakeKube

FAST = WatchTiming(
    start_timeout_s=3.0,
    request_timeout_s=2.0,
    watch_timeout_s=30.0,
    backoff_initial_s=0.01,
    backoff_max_s=0.05,
)

P = TypeVar("P")
W = TypeVar("W", bound=CustomResourceWatcher[Any, Any])


def server_config(url: str) -> SingleConfig:
    """The fake API server at ``url``, namespace ``ns``, no credentials."""
    config = KubeConfig.from_one(cluster=Cluster(server=url), namespace="ns").get()
    assert config is not None
    return config


class Recorder(Generic[P]):
    """Records ``on_change`` calls in ``calls``; ``wait`` blocks until the latest is the
    expected one."""

    def __init__(self) -> None:
        self.calls: list[P] = []
        self._cond = threading.Condition()

    def __call__(self, published: P) -> None:
        with self._cond:
            self.calls.append(published)
            self._cond.notify_all()

    def wait(self, expected: P, timeout_s: float = 5.0) -> None:
        with self._cond:
            if not self._cond.wait_for(
                lambda: bool(self.calls) and self.calls[-1] == expected, timeout_s
            ):
                raise AssertionError(f"expected {expected}, published {self.calls}")


@contextmanager
def watching(kube: FakeKube, kind: type[W], **kwargs: Any) -> Iterator[tuple[W, Recorder[Any]]]:
    """A ``kind`` watcher of namespace ``ns`` on ``kube`` with ``FAST`` timing, started;
    stopped after, with no watch thread left."""
    published: Recorder[Any] = Recorder()
    watcher = kind(server_config(kube.url), published, namespace="ns", timing=FAST, **kwargs)
    watcher.start()
    try:
        yield watcher, published
    finally:
        watcher.stop()
        assert not [t for t in threading.enumerate() if t.name.startswith("k8s-watch:")]
