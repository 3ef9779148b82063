"""The chart's ``tracing`` values: extproc's tracing flags, and in standalone mode Envoy's
OpenTelemetry tracer to the same collector, which Envoy accepts; off by default."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from extproc.admin.tracing import check_tracing_args
from extproc.cli import serve
from extproc.envoyconf.build import OTLP_CLUSTER
from testkit.chart import FULLNAME, clusters, envoy_config, find, render
from tests.envoyconf.support import hcm, validate

TRACING = {"tracing": {"otlpEndpoint": "otel-collector.monitoring:4317", "samplingRatio": 0.05}}


def picker_args(values: dict[str, Any]) -> list[str]:
    pod = find(render(values), "Deployment", FULLNAME)["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return container["args"]  # type: ignore[no-any-return]


def test_tracing_is_off_by_default() -> None:
    config = envoy_config({})
    assert "tracing" not in hcm(config) and OTLP_CLUSTER not in clusters(config)
    assert not [a for a in picker_args({}) if "otlp" in a or "trace" in a]


def test_tracing_values_reach_extprocs_flags() -> None:
    args = picker_args(TRACING)
    assert "--otlp-endpoint=otel-collector.monitoring:4317" in args
    assert "--trace-sampling=0.05" in args
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    parsed, _ = parser.parse_known_args(args)
    assert parsed.otlp_endpoint == "otel-collector.monitoring:4317"
    assert parsed.trace_sampling == 0.05
    check_tracing_args(parsed)


def test_tracing_turns_on_envoys_tracer_which_envoy_accepts(tmp_path: Path) -> None:
    config = envoy_config(TRACING)
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    validate(path)
    tracing = hcm(config)["tracing"]
    assert tracing["random_sampling"] == {"value": 5}
    assert tracing["provider"]["name"] == "envoy.tracers.opentelemetry"
    endpoint = clusters(config)[OTLP_CLUSTER]["load_assignment"]["endpoints"][0]
    assert endpoint["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] == {
        "address": "otel-collector.monitoring",
        "port_value": 4317,
    }


@pytest.mark.parametrize(
    ("tracing", "message"),
    [
        pytest.param({"samplingRatio": 1.5}, "samplingRatio", id="ratio-above-1"),
        pytest.param({"otlpEndpoint": "http://otel:4317"}, "otlpEndpoint", id="url"),
        pytest.param({"otlpEndpoint": "otel"}, "otlpEndpoint", id="no-port"),
    ],
)
def test_bad_tracing_values_are_refused(tracing: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=message):
        render({"tracing": tracing})
