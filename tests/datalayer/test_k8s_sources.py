"""Choosing the pod source from ``extproc serve`` flags, and serving from Kubernetes."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from extproc.cli import app, build_parser
from extproc.datalayer.k8s import KubePodSource
from extproc.datalayer.pods_file import PodsFileWatcher
from extproc.datalayer.sources import describe_source, make_pods_source
from extproc.errors import ConfigError
from testkit.example_pods import EXAMPLE_PODS_FILE
from testkit.waiting import wait_until
from tests.datalayer.fake_kube import FakeKube, inference_pool, k8s_pod

PODS = "/api/v1/namespaces/llm/pods"
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools"


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake


@pytest.fixture
def kubeconfig(kube: FakeKube, tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    data = {
        "current-context": "fake",
        "contexts": [{"name": "fake", "context": {"cluster": "c", "namespace": "llm"}}],
        "clusters": [{"name": "c", "cluster": {"server": kube.url}}],
    }
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def test_a_pods_file_is_watched() -> None:
    args = parse("--pods", str(EXAMPLE_PODS_FILE))
    source = make_pods_source(args, lambda pods: None)
    assert isinstance(source, PodsFileWatcher) and source.path == EXAMPLE_PODS_FILE
    assert describe_source(args) == str(EXAMPLE_PODS_FILE)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param([], r"no pods to route to.*--pods FILE.*--k8s-selector", id="none"),
        pytest.param(
            ["--pods", "x.yaml", "--k8s-selector", "a=b"], "not --pods and --k8s-selector", id="two"
        ),
        pytest.param(
            ["--k8s-selector", "a=b", "--inference-pool", "p"],
            "choose one pod source",
            id="k8s-two",
        ),
        pytest.param(["--k8s-selector", "a=b"], "needs --k8s-target-port", id="no-port"),
        pytest.param(
            ["--inference-pool", "p", "--k8s-target-port", "80"], "conflicts", id="pool-port"
        ),
        pytest.param(
            ["--k8s-selector", "a=b", "--k8s-target-port", "0"], "1-65535", id="port-zero"
        ),
        pytest.param(
            ["--k8s-selector", "a=b", "--k8s-target-port", "1", "--kubeconfig", "/nonexistent"],
            "cannot read",
            id="bad-kubeconfig",
        ),
    ],
)
def test_flag_errors(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_pods_source(parse(*flags), lambda pods: None)


def test_environment_defaults(monkeypatch: pytest.MonkeyPatch, kubeconfig: Path) -> None:
    monkeypatch.setenv("EXTPROC_INFERENCE_POOL", "pool")
    monkeypatch.setenv("EXTPROC_KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("EXTPROC_K8S_DEFAULT_MODEL", "base")
    args = parse()
    source = make_pods_source(args, lambda pods: None)
    assert isinstance(source, KubePodSource)
    assert (source.pool, source.namespace, source.mapping.default_model) == ("pool", "llm", "base")
    assert describe_source(args) == "InferencePool pool"


def test_serve_from_a_label_selector(kube: FakeKube, kubeconfig: Path) -> None:
    kube.put(PODS, k8s_pod("p0", "10.0.0.1", namespace="llm"))
    args = parse(
        "--grpc-port", "0", "--health-port", "0", "--metrics-port", "0",
        "--kubeconfig", str(kubeconfig), "--k8s-selector", "app=vllm", "--k8s-target-port", "8000",
        "--k8s-role-label", "role", "--k8s-model-label", "model",
    )  # fmt: skip
    assert describe_source(args) == "Kubernetes pods matching app=vllm"
    running = app.start(args, CollectorRegistry())
    try:
        assert [(p.address, p.models) for p in running.router.pods] == [
            ("10.0.0.1:8000", frozenset())
        ]
        kube.put(
            PODS, k8s_pod("p1", "10.0.0.2", namespace="llm", labels={"app": "vllm", "model": "m"})
        )
        wait_until(lambda: len(running.router.pods) >= 2, what="the router seeing the new pod")
        assert running.router.pods[1].models == {"m"}
    finally:
        running.stop(0)


def test_serve_from_an_inference_pool(kube: FakeKube, kubeconfig: Path) -> None:
    kube.put(PODS, k8s_pod("p0", "10.0.0.1", namespace="llm", labels={"pool": "a"}))
    kube.put(POOLS, inference_pool("pool", {"pool": "a"}, 8200, namespace="llm"))
    args = parse(
        "--grpc-port", "0", "--health-port", "0", "--metrics-port", "0",
        "--kubeconfig", str(kubeconfig), "--inference-pool", "pool", "--k8s-default-model", "base",
    )  # fmt: skip
    running = app.start(args, CollectorRegistry())
    try:
        assert [(p.address, p.models) for p in running.router.pods] == [
            ("10.0.0.1:8200", frozenset({"base"}))
        ]
    finally:
        running.stop(0)
