"""Render the chart offline with Helm v4 as a library (helm-python-sdk): no cluster, no
binary. The values each mode needs, and the rendered Envoy ConfigMap's bootstrap."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import helm_python
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART_DIR = REPO / "charts" / "extproc"
RELEASE = "rel"
FULLNAME = "rel-extproc"  # the chart's extproc.fullname for RELEASE
NAMESPACE = "llm"

# Values that make each mode render (external and gateway need the gateway's pods named).
GATEWAY_PEERS = [{"namespaceSelector": {"matchLabels": {"name": "gateway-system"}}}]
# The chart's precise prefix-cache values (KV events on, the precise scheduler, a PVC).
PRECISE: dict[str, Any] = yaml.safe_load((CHART_DIR / "values-precise.yaml").read_text())
MODES: dict[str, dict[str, Any]] = {
    "standalone": {},
    "external": {"mode": "external", "networkPolicy": {"gatewayFrom": GATEWAY_PEERS}},
    "gateway": {
        "mode": "gateway",
        "networkPolicy": {"gatewayFrom": GATEWAY_PEERS},
        "inferencePool": {"httpRoute": {"enabled": True, "parentRefs": [{"name": "gw"}]}},
    },
    "all-options": {
        "metrics": {"serviceMonitor": {"enabled": True}},
        "dashboards": {"enabled": True},
        "modelServers": {"modelLabel": "llm/model", "roleLabel": "llm/role"},
        "picker": {"extraArgs": ["--k8s-default-model", "qwen3"]},
        "replicas": 3,
        "redis": {"deploy": True},
    },
    "standalone-mtls-cert-manager": {
        "tls": {"mode": "mtls", "certManager": {"enabled": True, "issuerRef": {"name": "ca"}}},
    },
    "gateway-tls-secret": {
        "mode": "gateway",
        "networkPolicy": {"gatewayFrom": GATEWAY_PEERS},
        "tls": {"mode": "files", "secretName": "picker-cert"},
    },
    "view-snapshot-replicas": {
        "replicas": 3,
        "viewSnapshot": {"enabled": True, "persistence": {"storageClass": "nfs-client"}},
    },
    "precise-connect-replicas": {
        **PRECISE,
        "replicas": 3,
        "kvEvents": {**PRECISE["kvEvents"], "replayPort": 5558},
    },
    "precise-bind-gateway": {
        **PRECISE,
        "mode": "gateway",
        "networkPolicy": {"gatewayFrom": GATEWAY_PEERS},
        "kvEvents": {
            **PRECISE["kvEvents"],
            "topology": "bind",
            "tokenizers": {
                "mountPath": "/models",
                "volume": {"configMap": {"name": "qwen3-tokenizer"}},
            },
        },
    },
}


def render(values: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every manifest the chart renders for ``values`` (NOTES.txt left out).

    Raises:
        helm_python.HelmValuesError: the values fail values.schema.json.
        helm_python.HelmRenderError: a template failed (e.g. a ``fail`` rule).
    """
    chart = helm_python.Chart.load(CHART_DIR)
    try:
        files = chart.render(dict(values or {}), name=RELEASE, namespace=NAMESPACE)
    finally:
        chart.close()
    return [
        doc
        for path, text in sorted(files.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one manifest of ``kind`` (and ``name``)."""
    [found] = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    return found


def envoy_config(values: dict[str, Any]) -> dict[str, Any]:
    text = find(render(values), "ConfigMap", f"{FULLNAME}-envoy")["data"]["envoy.yaml"]
    return yaml.safe_load(text)  # type: ignore[no-any-return]


def clusters(config: dict[str, Any]) -> dict[str, Any]:
    return {c["name"]: c for c in config["static_resources"]["clusters"]}
