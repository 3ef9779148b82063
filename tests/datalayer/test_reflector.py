"""Reflector on lightkube against the fake API server: paging, errors, watch events, 410."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.config.models import Cluster, User
from lightkube.resources.core_v1 import Pod as K8sPod

from extproc.datalayer import reflector as reflector_module
from extproc.datalayer.kubeconfig import make_client
from extproc.datalayer.reflector import KubeApiError, Reflector
from tests.datalayer.fake_kube import FakeKube, k8s_pod

PODS = "/api/v1/namespaces/ns/pods"


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake


def config_for(url: str, token: str | None = None) -> SingleConfig:
    config = KubeConfig.from_one(
        cluster=Cluster(server=url), user=User(token=token), namespace="ns"
    ).get()
    assert config is not None
    return config


def ready(obj: K8sPod) -> bool:
    conditions = obj.status.conditions if obj.status else None
    return any(c.type == "Ready" and c.status == "True" for c in conditions or ())


async def with_reflector(url: str, action: Any, token: str | None = None, **kwargs: Any) -> Any:
    """Run ``action(reflector)`` with a pods reflector (name -> ready) on a fresh client."""
    client = make_client(config_for(url, token), request_timeout_s=5)
    changes: list[dict[str, bool]] = []
    reflector: Reflector[K8sPod, bool] = Reflector(
        client,
        K8sPod,
        namespace="ns",
        labels=kwargs.pop("labels", None),
        convert=ready,
        on_change=lambda: changes.append(dict(reflector.items)),
        what="pods in ns",
        **kwargs,
    )
    try:
        return await action(reflector, changes)
    finally:
        await client.close()


async def list_pods(reflector: Reflector[K8sPod, bool], _: object) -> tuple[list[str], str]:
    await reflector.list()
    assert reflector.resource_version is not None
    return sorted(reflector.items), reflector.resource_version


def test_list_follows_continue_tokens(kube: FakeKube) -> None:
    for idx in range(5):
        kube.put(PODS, k8s_pod(f"p{idx}", f"10.0.0.{idx + 1}"))
    kube.put(PODS, k8s_pod("other", labels={"app": "other"}))
    names, resource_version = asyncio.run(
        with_reflector(kube.url, list_pods, labels={"app": "vllm"}, page_size=2)
    )
    assert names == [f"p{idx}" for idx in range(5)]
    assert resource_version == str(kube.resource_version)
    lists = kube.requests_of("list")
    assert [r.query.get("continue") for r in lists] == [None, "2", "4"]
    assert all(r.query["limit"] == "2" and r.query["labelSelector"] == "app=vllm" for r in lists)


@pytest.mark.parametrize(
    ("status", "text"),
    [
        pytest.param(403, "list pods in ns: 403 Forbidden: injected failure", id="403"),
        pytest.param(500, "500 InternalError: injected failure", id="500"),
        pytest.param(410, "410 Expired", id="410"),
    ],
)
def test_list_error_status(kube: FakeKube, status: int, text: str) -> None:
    kube.fail_next(status)
    with pytest.raises(KubeApiError, match=text) as caught:
        asyncio.run(with_reflector(kube.url, list_pods))
    assert caught.value.status == status
    assert caught.value.gone is (status == 410)


def test_list_without_server() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(KubeApiError, match="list pods in ns: ConnectError") as caught:
        asyncio.run(with_reflector(f"http://127.0.0.1:{port}", list_pods))
    assert caught.value.status == 0


def test_watch_applies_changes_after_the_version(kube: FakeKube) -> None:
    rv = kube.put(PODS, k8s_pod("p0"))
    kube.put(PODS, k8s_pod("p1", "10.0.0.2"))
    kube.put(PODS, k8s_pod("p0", ready=False))
    kube.delete(PODS, "p1")

    async def watch(reflector: Reflector[K8sPod, bool], changes: list[Any]) -> list[Any]:
        reflector.resource_version = str(rv)  # as if listed then
        task = asyncio.create_task(reflector.run())
        while len(changes) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        return changes

    changes = asyncio.run(with_reflector(kube.url, watch, watch_timeout_s=5))
    assert changes == [{"p1": True}, {"p1": True, "p0": False}, {"p0": False}]
    query = kube.requests_of("watch")[0].query
    assert query["watch"] == "true" and query["allowWatchBookmarks"] == "true"
    assert query["timeoutSeconds"] == "5" and query["resourceVersion"] == str(rv)
    assert kube.requests_of("list") == []


@pytest.mark.parametrize("as_event", [False, True], ids=["http-410", "error-event"])
def test_watch_gone(kube: FakeKube, as_event: bool) -> None:
    kube.gone_as_event = as_event
    rv = kube.put(PODS, k8s_pod("p0"))
    kube.put(PODS, k8s_pod("p1", "10.0.0.2"))
    kube.compact()

    async def watch(reflector: Reflector[K8sPod, bool], _: object) -> None:
        reflector.resource_version = str(rv)
        await reflector._watch()

    text = "ERROR event: 410 Expired: too old resource version" if as_event else "410 Gone"
    with pytest.raises(KubeApiError, match=text) as caught:
        asyncio.run(with_reflector(kube.url, watch))
    assert caught.value.gone


def test_token_is_sent() -> None:
    with FakeKube(token="s3cret") as kube:
        kube.put(PODS, k8s_pod("p0"))
        with pytest.raises(KubeApiError, match="401 Unauthorized") as caught:
            asyncio.run(with_reflector(kube.url, list_pods))
        assert "RBAC" in str(caught.value)
        names, _ = asyncio.run(with_reflector(kube.url, list_pods, token="s3cret"))
        assert names == ["p0"]
        assert kube.requests_of("list")[-1].authorization == "Bearer s3cret"


def test_a_silent_watch_is_resumed(
    kube: FakeKube, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """lightkube sets no read timeout on watches: one silent past its timeout is dead."""
    monkeypatch.setattr(reflector_module, "WATCH_READ_SLACK_S", 0.2)
    kube.hold_watches = True
    rv = kube.put(PODS, k8s_pod("p0"))

    async def watch(reflector: Reflector[K8sPod, bool], _: object) -> None:
        reflector.resource_version = str(rv)
        task = asyncio.create_task(reflector.run())
        while len(kube.requests_of("watch")) < 2:
            await asyncio.sleep(0.01)
        task.cancel()

    with caplog.at_level(logging.WARNING, "extproc.datalayer"):
        asyncio.run(asyncio.wait_for(with_reflector(kube.url, watch, watch_timeout_s=1), timeout=5))
    assert f"from resourceVersion {rv}: timed out; retrying in" in caplog.text
    assert [r.query["resourceVersion"] for r in kube.requests_of("watch")] == [str(rv)] * 2
