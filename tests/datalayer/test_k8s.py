"""KubePodSource against the fake API server: list, watch, resume, 410, bookmarks, pools."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.config.models import Cluster

from extproc.datalayer.k8s import KubePodSource, WatchTiming
from extproc.datalayer.k8s_objects import PodTarget
from extproc.errors import ConfigError
from extproc.pods import Pod
from testkit.waiting import wait_until
from tests.datalayer.crd_watching import FAST
from tests.datalayer.fake_kube import FakeKube, inference_pool, k8s_pod

PODS = "/api/v1/namespaces/ns/pods"
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/ns/inferencepools"
SELECTOR = PodTarget("app=vllm", (8000,))


def server_config(url: str, context: str = "test") -> SingleConfig:
    """A config for the fake API server: no credentials, namespace ns."""
    config = KubeConfig.from_one(
        cluster=Cluster(server=url), context_name=context, namespace="ns"
    ).get()
    assert config is not None
    return config


class Published:
    """Records ``on_change`` calls; ``wait`` blocks until the latest satisfies a condition."""

    def __init__(self) -> None:
        self.snapshots: list[tuple[Pod, ...]] = []
        self._cond = threading.Condition()

    def __call__(self, pods: tuple[Pod, ...]) -> None:
        with self._cond:
            self.snapshots.append(pods)
            self._cond.notify_all()

    def wait(self, expected: dict[str, bool], timeout_s: float = 5.0) -> tuple[Pod, ...]:
        """Wait until the latest snapshot is exactly ``{name: ready}``."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: bool(self.snapshots) and ready_by_name(self.snapshots[-1]) == expected,
                timeout_s,
            ):
                last = ready_by_name(self.snapshots[-1]) if self.snapshots else None
                raise AssertionError(f"expected {expected}, last published {last}")
            return self.snapshots[-1]


def ready_by_name(pods: tuple[Pod, ...]) -> dict[str, bool]:
    return {p.id.name: p.ready for p in pods}


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake


@contextmanager
def running(
    kube: FakeKube, on_change: Callable[[tuple[Pod, ...]], Any] | None = None, **kwargs: Any
) -> Iterator[tuple[KubePodSource, Published]]:
    published = Published()
    source = KubePodSource(
        server_config(kube.url),
        on_change or published,
        namespace="ns",
        timing=FAST,
        **kwargs,
    )
    source.start()
    try:
        yield source, published
    finally:
        source.stop()
        assert not [t for t in threading.enumerate() if t.name.startswith("k8s-watch:")]


def test_start_lists_then_follows_pod_changes(kube: FakeKube) -> None:
    kube.put(PODS, k8s_pod("p0", "10.0.0.1"))
    kube.put(PODS, k8s_pod("other", "10.0.0.9", labels={"app": "other"}))
    with running(kube, target=SELECTOR) as (source, published):
        assert ready_by_name(source.pods) == {"p0": True}
        assert published.snapshots == [source.pods]
        assert source.pods[0].address == "10.0.0.1:8000"
        assert kube.requests_of("list")[0].query["labelSelector"] == "app=vllm"
        kube.wait_for_watches(1)
        kube.put(PODS, k8s_pod("p1", "10.0.0.2"))
        published.wait({"p0": True, "p1": True})
        kube.put(PODS, k8s_pod("p0", "10.0.0.1", ready=False))
        published.wait({"p0": False, "p1": True})
        kube.put(PODS, k8s_pod("p1", "10.0.0.2", deleting=True))
        published.wait({"p0": False, "p1": False})
        kube.put(PODS, k8s_pod("p0", "10.0.0.1", labels={"app": "other"}))  # leaves the selector
        published.wait({"p1": False})
        kube.delete(PODS, "p1")
        published.wait({})
        assert len(kube.requests_of("list")) == 1


def test_an_unchanged_pod_is_not_published_again(kube: FakeKube) -> None:
    kube.put(PODS, k8s_pod("p0"))
    with running(kube, target=SELECTOR) as (_, published):
        kube.wait_for_watches(1)
        kube.put(PODS, k8s_pod("p0", annotations={"unrelated": "x"}))
        kube.put(PODS, k8s_pod("p1", "10.0.0.2"))
        published.wait({"p0": True, "p1": True})
        assert len(published.snapshots) == 2


@pytest.mark.parametrize(
    "abrupt", [pytest.param(False, id="server-ends"), pytest.param(True, id="dropped")]
)
def test_watch_resumes_from_last_version(kube: FakeKube, abrupt: bool) -> None:
    kube.put(PODS, k8s_pod("p0"))
    with running(kube, target=SELECTOR) as (_, published):
        kube.wait_for_watches(1)
        rv = kube.put(PODS, k8s_pod("p1", "10.0.0.2"))
        published.wait({"p0": True, "p1": True})
        assert kube.drop_watches(abrupt=abrupt) == 1
        kube.put(PODS, k8s_pod("p2", "10.0.0.3"))  # during the gap or after: not lost
        published.wait({"p0": True, "p1": True, "p2": True})
        watches = kube.requests_of("watch")
        assert watches[1].query["resourceVersion"] == str(rv)
        assert len(kube.requests_of("list")) == 1


@pytest.mark.parametrize(
    "as_event", [pytest.param(False, id="http-410"), pytest.param(True, id="error-event-410")]
)
def test_gone_lists_again(kube: FakeKube, as_event: bool) -> None:
    kube.gone_as_event = as_event
    kube.put(PODS, k8s_pod("p0"))
    kube.put(PODS, k8s_pod("p1", "10.0.0.2"))
    with running(kube, target=SELECTOR) as (_, published):
        kube.wait_for_watches(1)
        kube.pause_watches(True)  # a partition: the client misses these changes
        kube.delete(PODS, "p1")
        kube.put(PODS, k8s_pod("p2", "10.0.0.3"))
        kube.compact()  # and the history that would replay them is gone
        kube.pause_watches(False)
        kube.drop_watches()
        published.wait({"p0": True, "p2": True})  # the deletion came from the re-list
        assert len(kube.requests_of("list")) == 2


def test_bookmark_moves_the_resume_version(kube: FakeKube) -> None:
    kube.put(PODS, k8s_pod("p0"))
    with running(kube, target=SELECTOR) as (_, published):
        kube.wait_for_watches(1)
        for idx in range(3):  # changes the watch does not see, but which move the version
            kube.put(PODS, k8s_pod(f"x{idx}", labels={"app": "other"}))
        rv = kube.bookmark()
        kube.compact()  # resuming from before the bookmark would now be 410
        kube.drop_watches()
        wait_until(lambda: len(kube.requests_of("watch")) >= 2)
        assert kube.requests_of("watch")[1].query["resourceVersion"] == str(rv)
        assert kube.requests_of("watch")[1].query["allowWatchBookmarks"] == "true"
        kube.put(PODS, k8s_pod("p1", "10.0.0.2"))
        published.wait({"p0": True, "p1": True})
        assert len(kube.requests_of("list")) == 1


def test_error_event_backs_off_and_resumes(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    kube.put(PODS, k8s_pod("p0"))
    with running(kube, target=SELECTOR) as (_, published):
        kube.wait_for_watches(1)
        rv = kube.put(PODS, k8s_pod("p1", "10.0.0.2"))
        published.wait({"p0": True, "p1": True})
        with caplog.at_level(logging.WARNING, "extproc.datalayer"):
            kube.error_event(500, "etcd hiccup")
            wait_until(lambda: len(kube.requests_of("watch")) >= 2)
        assert kube.requests_of("watch")[1].query["resourceVersion"] == str(rv)
        assert "ERROR event: 500 InternalError: etcd hiccup; retrying in" in caplog.text
        kube.put(PODS, k8s_pod("p2", "10.0.0.3"))
        published.wait({"p0": True, "p1": True, "p2": True})
        assert len(kube.requests_of("list")) == 1


def test_failing_requests_are_retried(kube: FakeKube) -> None:
    kube.put(PODS, k8s_pod("p0"))
    kube.fail_next(503)  # the first list fails too: start() retries it
    with running(kube, target=SELECTOR) as (_, published):
        published.wait({"p0": True})
        kube.wait_for_watches(1)
        kube.fail_next(500, 429, 403)
        kube.drop_watches(abrupt=True)
        kube.put(PODS, k8s_pod("p1", "10.0.0.2"))
        published.wait({"p0": True, "p1": True})
        assert len(kube.requests_of("watch")) >= 5
        assert len(kube.requests_of("list")) == 2


def test_on_change_error_is_logged_and_published_again(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    published = Published()
    calls = []

    def flaky(pods: tuple[Pod, ...]) -> None:
        calls.append(pods)
        if len(calls) == 2:
            raise RuntimeError("bug in the consumer")
        published(pods)

    kube.put(PODS, k8s_pod("p0"))
    with running(kube, on_change=flaky, target=SELECTOR) as (source, _):
        kube.wait_for_watches(1)
        kube.put(PODS, k8s_pod("p1", "10.0.0.2"))
        published.wait({"p0": True, "p1": True})
        assert "bug in the consumer" in caplog.text
        assert len(kube.requests_of("list")) == 2  # the failed change is re-listed
        assert ready_by_name(source.pods) == {"p0": True, "p1": True}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_start_fails_clearly_without_api_server() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    timing = WatchTiming(start_timeout_s=0.3, backoff_initial_s=0.01, backoff_max_s=0.05)
    source = KubePodSource(
        server_config(url, "test"), Published(), namespace="ns", target=SELECTOR, timing=timing
    )
    started_s = time.monotonic()
    with pytest.raises(
        ConfigError,
        match=rf"could not list from the Kubernetes API server {url} \(test\) within 0.3 s: list pods",
    ):
        source.start()
    assert time.monotonic() - started_s < 2.0
    assert not [t for t in threading.enumerate() if t.name.startswith("k8s-watch:")]


def test_start_fails_clearly_when_forbidden(kube: FakeKube) -> None:
    kube.fail_next(*[403] * 200)
    timing = WatchTiming(start_timeout_s=0.3, backoff_initial_s=0.01, backoff_max_s=0.05)
    source = KubePodSource(
        server_config(kube.url), Published(), namespace="ns", target=SELECTOR, timing=timing
    )
    with pytest.raises(ConfigError, match="403 Forbidden: injected failure .*RBAC"):
        source.start()


def pool_pod(name: str, ip: str, pool: str) -> dict[str, Any]:
    return k8s_pod(name, ip, labels={"pool": pool, "extproc.io/model": "m"})


def test_pool_selects_pods_and_follows_its_changes(kube: FakeKube) -> None:
    kube.put(PODS, pool_pod("a0", "10.0.0.1", "a"))
    kube.put(PODS, pool_pod("a1", "10.0.0.2", "a"))
    kube.put(PODS, pool_pod("b0", "10.0.0.3", "b"))
    kube.put(POOLS, inference_pool("pool", {"pool": "a"}, 8000))
    kube.put(POOLS, inference_pool("another", {"pool": "b"}, 8000))
    with running(kube, pool="pool") as (source, published):
        assert ready_by_name(source.pods) == {"a0": True, "a1": True}
        assert {p.address for p in source.pods} == {"10.0.0.1:8000", "10.0.0.2:8000"}
        assert kube.requests_of("list")[0].query["fieldSelector"] == "metadata.name=pool"
        kube.wait_for_watches(2)
        kube.put(POOLS, inference_pool("pool", {"pool": "b"}, 8000))  # selector change
        published.wait({"b0": True})
        kube.put(POOLS, inference_pool("pool", {"pool": "b"}, 9000))  # port change
        wait_until(lambda: [p.address for p in source.pods] == ["10.0.0.3:9000"])
        kube.put(PODS, pool_pod("b1", "10.0.0.4", "b"))  # the new pod watch follows pods
        published.wait({"b0": True, "b1": True})
        kube.put(POOLS, inference_pool("pool", {}, 9000))  # invalid: keeps the last target
        kube.put(POOLS, inference_pool("another", {"pool": "a"}, 8000))  # not ours
        kube.put(PODS, pool_pod("b2", "10.0.0.5", "b"))
        published.wait({"b0": True, "b1": True, "b2": True})
        kube.delete(POOLS, "pool")
        published.wait({})
        kube.put(POOLS, inference_pool("pool", {"pool": "a"}, 8000))
        published.wait({"a0": True, "a1": True})
        wait_until(lambda: kube.num_watches() == 2)  # one pool watch, one pod watch


def ranked_pool(*ports: int) -> dict[str, Any]:
    pool = inference_pool("pool", {"pool": "a"}, ports[0])
    pool["spec"]["targetPorts"] = [{"number": port} for port in ports]
    return pool


def test_every_target_port_of_a_pool_is_an_endpoint(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    kube.put(PODS, pool_pod("a0", "10.0.0.1", "a"))
    kube.put(POOLS, ranked_pool(8000, 8001))
    with caplog.at_level(logging.INFO), running(kube, pool="pool") as (source, published):
        assert [(p.id.name, p.address) for p in source.pods] == [
            ("a0-rank-0", "10.0.0.1:8000"),
            ("a0-rank-1", "10.0.0.1:8001"),
        ]
        assert "selecting pods matching pool=a on ports 8000, 8001" in caplog.text
        kube.wait_for_watches(2)
        kube.put(PODS, pool_pod("a1", "10.0.0.2", "a"))
        published.wait({f"a{i}-rank-{r}": True for i in (0, 1) for r in (0, 1)})
        kube.put(POOLS, ranked_pool(8000, 8001, 8002))  # a rank more
        wait_until(lambda: len(source.pods) == 6)
        assert source.pods[5].address == "10.0.0.2:8002"
        kube.delete(PODS, "a0")  # a deleted pod takes all its ranks with it
        published.wait({f"a1-rank-{r}": True for r in (0, 1, 2)})
        kube.put(POOLS, ranked_pool(8000))  # one port: the pod's own name again
        published.wait({"a1": True})


def test_pool_created_after_start(kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    kube.put(PODS, pool_pod("a0", "10.0.0.1", "a"))
    with running(kube, pool="pool") as (source, published):
        assert source.pods == ()
        assert "InferencePool ns/pool does not exist: no pods until it does" in caplog.text
        kube.wait_for_watches(1)
        kube.put(POOLS, inference_pool("pool", {"pool": "a"}, 8000))
        published.wait({"a0": True})


def test_pool_v1alpha2(kube: FakeKube) -> None:
    path = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/ns/inferencepools"
    kube.put(PODS, pool_pod("a0", "10.0.0.1", "a"))
    kube.put(path, inference_pool("pool", {"pool": "a"}, 8200, v1=False))
    with running(kube, pool="pool", pool_api="inference.networking.x-k8s.io/v1alpha2") as (
        source,
        _,
    ):
        assert [p.address for p in source.pods] == ["10.0.0.1:8200"]


def test_pod_problems_are_logged_once(kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    kube.put(PODS, k8s_pod("nomodel", "10.0.0.1", labels={"app": "vllm"}))
    kube.put(PODS, k8s_pod("p0", "10.0.0.2"))
    kube.put(PODS, k8s_pod("p1", "10.0.0.2"))  # same address as p0
    with running(kube, target=SELECTOR) as (source, published):
        assert ready_by_name(source.pods) == {"nomodel": True, "p0": True}
        kube.wait_for_watches(1)
        kube.put(PODS, k8s_pod("p2", "10.0.0.3"))
        published.wait({"nomodel": True, "p0": True, "p2": True})
    assert caplog.text.count("pod ns/nomodel: no served model") == 1
    assert caplog.text.count("pod ns/p1: ignored: another pod has its address 10.0.0.2:8000") == 1


def test_exactly_one_mode() -> None:
    config = server_config("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="exactly one"):
        KubePodSource(config, Published(), namespace="ns")
    with pytest.raises(ValueError, match="exactly one"):
        KubePodSource(config, Published(), namespace="ns", target=SELECTOR, pool="p")


def test_a_bad_selector_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="label selector 'app=vllm,,x y': cannot parse ''"):
        KubePodSource(
            server_config("http://127.0.0.1:1"),
            Published(),
            namespace="ns",
            target=PodTarget("app=vllm,,x y", (8000,)),
        )


def test_start_fails_when_on_change_raises(kube: FakeKube) -> None:
    def broken(pods: tuple[Pod, ...]) -> None:
        raise RuntimeError("consumer bug")

    kube.put(PODS, k8s_pod("p0"))
    source = KubePodSource(
        server_config(kube.url), broken, namespace="ns", target=SELECTOR, timing=FAST
    )
    with pytest.raises(ConfigError, match="start-up failed: RuntimeError\\('consumer bug'\\)"):
        source.start()
    assert not [t for t in threading.enumerate() if t.name.startswith("k8s-watch:")]
