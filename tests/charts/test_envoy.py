"""The standalone Envoy's bootstrap: generated from extproc/envoyconf, and Envoy accepts it.

``_envoy-config.tpl`` is ``python -m extproc.envoyconf.helm``'s output (the code that
writes envoy/envoy.yaml, with Helm expressions where values go); the rendered ConfigMap
must pass ``envoy --mode validate`` and carry the values it was given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.envoyconf import helm
from testkit.chart import FULLNAME, NAMESPACE, PRECISE, clusters, envoy_config, find, render
from tests.envoyconf.support import hcm, validate


def test_template_is_what_the_generator_writes() -> None:
    assert helm.TEMPLATE_PATH.read_text() == helm.render_template(), (
        "regenerate: python -m extproc.envoyconf.helm"
    )


def socket(cluster: dict[str, Any]) -> dict[str, Any]:
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    return endpoint["address"]["socket_address"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "values",
    [
        pytest.param({}, id="defaults"),
        pytest.param(
            {
                "envoy": {
                    "failureModeAllow": True,
                    "messageTimeoutSeconds": 0.25,
                    "maxMessageTimeoutSeconds": 40,
                },
                "picker": {"numFallbacks": 0, "maxBodyBytes": 1048576, "sessionHeader": "x-t"},
                "modelServers": {"targetPort": 9000},
                "clusterDomain": "corp.local",
            },
            id="custom",
        ),
        pytest.param(PRECISE, id="precise"),  # KV events on: the Envoy is the same
    ],
)
def test_rendered_bootstrap_validates_and_follows_values(
    values: dict[str, Any], tmp_path: Path
) -> None:
    config = envoy_config(values)
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    validate(path)

    envoy, picker = values.get("envoy", {}), values.get("picker", {})
    domain = f"{NAMESPACE}.svc.{values.get('clusterDomain', 'cluster.local')}"
    found = clusters(config)
    extproc = {"address": f"{FULLNAME}-replicas.{domain}", "port_value": 9002}  # headless
    assert socket(found["extproc"]) == extproc
    assert found["extproc_pods"]["type"] == "STRICT_DNS"
    assert socket(found["extproc_pods"]) == {
        "address": f"{FULLNAME}-model-servers.{domain}",
        "port_value": values.get("modelServers", {}).get("targetPort", 8000),
    }
    ext_proc = hcm(config)["http_filters"][0]["typed_config"]
    assert ext_proc["failure_mode_allow"] is envoy.get("failureModeAllow", False)
    assert ext_proc["message_timeout"] == f"{envoy.get('messageTimeoutSeconds', 10)}s"
    assert ext_proc["max_message_timeout"] == f"{envoy.get('maxMessageTimeoutSeconds', 60)}s"
    header = picker.get("sessionHeader", "x-session-id")
    assert ext_proc["request_attributes"][2:] == [
        f"request.headers['{header}']",
        "request.headers['x-gateway-inference-objective']",
        "request.headers['x-gateway-inference-fairness-id']",
    ]
    route = hcm(config)["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["retry_policy"]["num_retries"] == picker.get("numFallbacks", 2)
    body_limit = picker.get("maxBodyBytes", 16777216)
    assert config["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] == (
        body_limit
    )
    assert hcm(config)["http_filters"][1]["typed_config"]["max_request_bytes"] == body_limit


def test_envoy_pod_and_services() -> None:
    docs = render()
    pod = find(docs, "Deployment", f"{FULLNAME}-envoy")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["ports"] == [{"name": "http", "containerPort": helm.LISTEN_PORT}]
    assert "--config-path=/etc/envoy/envoy.yaml" in container["args"]
    headless = find(docs, "Service", f"{FULLNAME}-model-servers")["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"] == {"app": "vllm"}


@pytest.mark.parametrize(
    ("sentinel", "problem"),
    [
        pytest.param(helm.Sentinel("no-such-text", "x", 1), "occurs 0 times", id="missing"),
        pytest.param(helm.Sentinel("port_value:", "x", 1), "occurs 5 times", id="several"),
    ],
)
def test_generator_refuses_a_sentinel_that_does_not_fit(
    sentinel: helm.Sentinel, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(helm, "_SENTINELS", (sentinel,))
    with pytest.raises(ValueError, match=problem):
        helm.render_template()
