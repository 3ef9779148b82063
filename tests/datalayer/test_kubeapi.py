"""KubeApi against the fake API server: paging, errors as KubeApiError, watch events."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from extproc.datalayer.kubeapi import KubeApi, KubeApiError, WatchEvent
from extproc.datalayer.kubeconfig import KubeConfig
from tests.datalayer.fake_kube import FakeKube, k8s_pod

PODS = "/api/v1/namespaces/ns/pods"


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def list_pods(url: str, token: str | None = None, **kwargs: Any) -> tuple[list[str], str]:
    api = KubeApi(KubeConfig(url, token=token), **kwargs)
    try:
        result = await api.list(PODS, {"labelSelector": "app=vllm"})
    finally:
        await api.close()
    return [item["metadata"]["name"] for item in result.items], result.resource_version


async def watch_pods(url: str, resource_version: str, num_events: int) -> list[WatchEvent]:
    api = KubeApi(KubeConfig(url))
    events: list[WatchEvent] = []
    try:
        stream = api.watch(PODS, {}, resource_version=resource_version, timeout_s=5)
        async with contextlib.aclosing(stream):
            async for event in stream:
                events.append(event)
                if len(events) == num_events:
                    break
    finally:
        await api.close()
    return events


def test_list_follows_continue_tokens(kube: FakeKube) -> None:
    for idx in range(5):
        kube.put(PODS, k8s_pod(f"p{idx}", f"10.0.0.{idx + 1}"))
    kube.put(PODS, k8s_pod("other", labels={"app": "other"}))
    names, resource_version = run(list_pods(kube.url, page_size=2))
    assert names == [f"p{idx}" for idx in range(5)]
    assert resource_version == str(kube.resource_version)
    lists = kube.requests_of("list")
    assert [r.query.get("continue") for r in lists] == [None, "2", "4"]
    assert all(r.query["limit"] == "2" and r.query["labelSelector"] == "app=vllm" for r in lists)


@pytest.mark.parametrize(
    ("status", "text"),
    [
        pytest.param(403, "list /api/v1/namespaces/ns/pods: 403 Forbidden: injected", id="403"),
        pytest.param(500, "500 InternalError: injected failure", id="500"),
        pytest.param(410, "410 Expired", id="410"),
    ],
)
def test_list_error_status(kube: FakeKube, status: int, text: str) -> None:
    kube.fail_next(status)
    with pytest.raises(KubeApiError, match=text) as caught:
        run(list_pods(kube.url))
    assert caught.value.status == status
    assert caught.value.gone is (status == 410)


def test_list_without_server() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(KubeApiError, match=f"list {PODS}: Cannot connect") as caught:
        run(list_pods(f"http://127.0.0.1:{port}"))
    assert caught.value.status == 0


def test_watch_replays_changes_after_the_version(kube: FakeKube) -> None:
    rv = kube.put(PODS, k8s_pod("p0"))
    kube.put(PODS, k8s_pod("p1", "10.0.0.2"))
    kube.put(PODS, k8s_pod("p0", ready=False))
    kube.delete(PODS, "p1")
    events = run(watch_pods(kube.url, str(rv), 3))
    assert [(e.type, e.object["metadata"]["name"]) for e in events] == [
        ("ADDED", "p1"),
        ("MODIFIED", "p0"),
        ("DELETED", "p1"),
    ]
    query = kube.requests_of("watch")[0].query
    assert query["watch"] == "1" and query["allowWatchBookmarks"] == "true"
    assert query["timeoutSeconds"] == "5"


@pytest.mark.parametrize("as_event", [False, True], ids=["http-410", "error-event"])
def test_watch_gone(kube: FakeKube, as_event: bool) -> None:
    kube.gone_as_event = as_event
    rv = kube.put(PODS, k8s_pod("p0"))
    kube.put(PODS, k8s_pod("p1", "10.0.0.2"))
    kube.compact()
    with pytest.raises(KubeApiError, match="too old resource version") as caught:
        run(watch_pods(kube.url, str(rv), 1))
    assert caught.value.gone


def test_token_is_sent() -> None:
    with FakeKube(token="s3cret") as kube:
        kube.put(PODS, k8s_pod("p0"))
        with pytest.raises(KubeApiError, match="401 Unauthorized") as caught:
            run(list_pods(kube.url))
        assert "RBAC" in str(caught.value)
        names, _ = run(list_pods(kube.url, token="s3cret"))
        assert names == ["p0"]
        assert kube.requests_of("list")[-1].authorization == "Bearer s3cret"
