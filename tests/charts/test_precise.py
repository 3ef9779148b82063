"""The chart's precise prefix-cache values (``kvEvents``, values-precise.yaml).

Off (the default), nothing new renders; on, the picker gets the KV-events flags, the
tokenizer volume read-only where the plugin's ``models`` map points, the precise
scheduler in its ConfigMap and, in the bind topology, the events port on its container,
Service and NetworkPolicy. Lint, Kubernetes' schemas and the serve-flags check run on
the precise modes with every other mode (conftest.MODES); the rules that refuse bad
values are in test_values.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from prometheus_client import CollectorRegistry

from extproc.cli import serve
from extproc.datalayer.kv_events import EventsSettings, settings_from_args
from extproc.scheduling.config import build_scheduler, named_config_text, parse_config
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from testkit.chart import CHART_DIR, MODES, NAMESPACE, PRECISE, RELEASE, find, render
from testkit.factories import write_tokenizer

FULLNAME = "rel-extproc"
DEFAULT_PORTS = {9002, 9003, 9090}


def picker_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def kv_args(docs: list[dict[str, Any]]) -> list[str]:
    [container] = picker_pod(docs)["containers"]
    return [a for a in container["args"] if a.startswith("--kv-events")]


def test_events_off_renders_nothing_new() -> None:
    """Every kvEvents value but ``enabled`` changed: still exactly the default chart."""
    off = {
        "enabled": False,
        "topology": "bind",
        "port": 6000,
        "replayPort": 6001,
        "tokenizers": {
            "mountPath": "/tok",
            "volume": {"persistentVolumeClaim": {"claimName": "t"}},
        },
    }
    docs = render()
    assert render({"kvEvents": off}) == docs
    assert kv_args(docs) == []
    assert "tokenizers" not in {v["name"] for v in picker_pod(docs)["volumes"]}
    assert {p["port"] for p in find(docs, "Service", FULLNAME)["spec"]["ports"]} == DEFAULT_PORTS


@pytest.mark.parametrize(
    ("mode", "args", "settings"),
    [
        pytest.param(
            "precise-connect-replicas",
            [
                "--kv-events-topology=connect",
                "--kv-events-port=5557",
                "--kv-events-replay-port=5558",
            ],
            EventsSettings("connect", 5557, (), 5558),
            id="connect-replay",
        ),
        pytest.param(
            "precise-bind-gateway",
            ["--kv-events-topology=bind", "--kv-events-bind=tcp://0.0.0.0:5557"],
            EventsSettings("bind", 5557, ("tcp://0.0.0.0:5557",), None),
            id="bind",
        ),
    ],
)
def test_events_on_render_the_flags_volume_and_ports(
    mode: str, args: list[str], settings: EventsSettings
) -> None:
    values = MODES[mode]
    kv = values["kvEvents"]
    docs = render(values)
    pod = picker_pod(docs)
    [container] = pod["containers"]
    assert kv_args(docs) == args
    # the flags mean what the values say to extproc serve's own parser
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    assert settings_from_args(parser.parse_args(container["args"])) == settings
    # the tokenizers: the operator's volume source, read-only at mountPath
    [volume] = [v for v in pod["volumes"] if v["name"] == "tokenizers"]
    assert volume == {"name": "tokenizers", **kv["tokenizers"]["volume"]}
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "tokenizers"]
    assert mount == {"name": "tokenizers", "mountPath": "/models", "readOnly": True}
    # bind: the port extproc binds, on the container, the Service and the NetworkPolicy
    binds = kv["topology"] == "bind"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports.get("kv-events") == (5557 if binds else None)
    service = {p["name"]: p for p in find(docs, "Service", FULLNAME)["spec"]["ports"]}
    if binds:
        assert service["tcp-kv-events"] == {
            "name": "tcp-kv-events",
            "port": 5557,
            "targetPort": "kv-events",
        }
    else:
        assert "tcp-kv-events" not in service
    rules = find(docs, "NetworkPolicy")["spec"]["ingress"]
    events_rules = [r for r in rules if {"port": 5557, "protocol": "TCP"} in r["ports"]]
    assert events_rules == (
        [
            {
                "ports": [{"port": 5557, "protocol": "TCP"}],
                "from": [{"podSelector": {"matchLabels": {"app": "vllm"}}}],
            }
        ]
        if binds
        else []
    )


def test_precise_values_carry_extprocs_precise_configuration() -> None:
    assert PRECISE["scheduler"] == yaml.safe_load(named_config_text("precise"))["scheduler"]
    text = find(render(PRECISE), "ConfigMap", FULLNAME)["data"]["config.yaml"]
    assert yaml.safe_load(text) == {"scheduler": PRECISE["scheduler"]}


def test_the_configmap_builds_the_precise_scheduler_from_the_mounted_tokenizers(
    tmp_path: Path,
) -> None:
    """The rendered config.yaml loads as extproc serve loads it, with the mount at tmp_path."""
    write_tokenizer(tmp_path / "qwen3-tiny")
    text = find(render(PRECISE), "ConfigMap", FULLNAME)["data"]["config.yaml"]
    config = parse_config(text.replace("/models/", f"{tmp_path}/"), "chart ConfigMap")
    scheduler = build_scheduler(config, CollectorRegistry())
    [precise] = [ws.scorer for ws in scheduler.scorers if isinstance(ws.scorer, PrecisePrefixCache)]
    assert precise.tokenizers["qwen3-tiny"].tokens("hello world") == [1, 2]


# vLLM's KVEventsConfig fields (vllm/config/kv_events.py, vLLM 0.32).
VLLM_KV_EVENTS_FIELDS = {
    "enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps",
    "hwm", "max_queue_size", "topic",
}  # fmt: skip


def notes(values: dict[str, Any]) -> str:
    chart = helm_python.Chart.load(CHART_DIR)
    try:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    finally:
        chart.close()
    [text] = [text for path, text in files.items() if path.endswith("NOTES.txt")]
    return text


@pytest.mark.parametrize(
    ("kv_events", "expected"),
    [
        pytest.param(
            {},
            {"endpoint": "tcp://*:5557"},
            id="connect",
        ),
        pytest.param(
            {"topology": "bind", "replayPort": 5558},
            {
                "endpoint": f"tcp://{FULLNAME}.{NAMESPACE}.svc.cluster.local:5557",
                "topic": "kv@$(POD_IP):8000@<model>",
                "replay_endpoint": "tcp://*:5558",
            },
            id="bind-replay",
        ),
    ],
)
def test_notes_print_the_model_servers_kv_events_config(
    kv_events: dict[str, Any], expected: dict[str, str]
) -> None:
    text = notes({**PRECISE, "kvEvents": {**PRECISE["kvEvents"], **kv_events}})
    [line] = [line for line in text.splitlines() if "--kv-events-config" in line]
    config = json.loads(line.split("'")[1])
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", **expected}
    assert set(config) <= VLLM_KV_EVENTS_FIELDS
    assert "--kv-events-config" not in notes({})
