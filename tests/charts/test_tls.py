"""TLS on the picker's gRPC port in the chart: each chart mode's default, the Secret and
cert-manager wiring, and the standalone Envoy's matching bootstrap (Envoy validates it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from testkit.chart import FULLNAME, GATEWAY_PEERS, clusters, envoy_config, find, render
from testkit.tls_certs import CertAuthority
from tests.envoyconf.support import validate

CERT_MANAGER = {"enabled": True, "issuerRef": {"name": "cluster-ca", "kind": "ClusterIssuer"}}
GATEWAY = {"mode": "gateway", "networkPolicy": {"gatewayFrom": GATEWAY_PEERS}}
EXTERNAL = {"mode": "external", "networkPolicy": {"gatewayFrom": GATEWAY_PEERS}}


def picker(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def tls_args(docs: list[dict[str, Any]]) -> list[str]:
    [container] = picker(docs)["containers"]
    return [a for a in container["args"] if "tls" in a]


@pytest.mark.parametrize(
    ("values", "mode"),
    [
        pytest.param({}, "off", id="standalone"),
        pytest.param(EXTERNAL, "off", id="external"),
        pytest.param(GATEWAY, "self-signed", id="gateway"),
    ],
)
def test_each_chart_mode_has_its_default(values: dict[str, Any], mode: str) -> None:
    docs = render(values)
    assert tls_args(docs) == [f"--grpc-tls={mode}"]
    assert not [v for v in picker(docs)["volumes"] if v["name"] == "tls"]


def test_mtls_from_cert_manager_wires_picker_and_envoy() -> None:
    docs = render({"tls": {"mode": "mtls", "certManager": CERT_MANAGER}})
    assert tls_args(docs) == [
        "--grpc-tls=mtls",
        "--tls-cert-file=/etc/extproc/tls/tls.crt",
        "--tls-key-file=/etc/extproc/tls/tls.key",
        "--tls-client-ca-file=/etc/extproc/tls/ca.crt",
    ]
    [tls_volume] = [v for v in picker(docs)["volumes"] if v["name"] == "tls"]
    assert tls_volume["secret"]["secretName"] == f"{FULLNAME}-tls"
    server = find(docs, "Certificate", FULLNAME)["spec"]
    assert server["secretName"] == f"{FULLNAME}-tls"
    assert f"{FULLNAME}.llm.svc.cluster.local" in server["dnsNames"]
    assert server["issuerRef"] == {
        "name": "cluster-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    client = find(docs, "Certificate", f"{FULLNAME}-envoy-client")["spec"]
    assert client["usages"] == ["client auth"]
    envoy_pod = find(docs, "Deployment", f"{FULLNAME}-envoy")["spec"]["template"]["spec"]
    volumes = {v["name"]: v["secret"] for v in envoy_pod["volumes"] if "secret" in v}
    assert volumes == {
        "extproc-ca": {
            "secretName": f"{FULLNAME}-tls",
            "items": [{"key": "ca.crt", "path": "ca.crt"}],  # never extproc's key
        },
        "client-tls": {"secretName": f"{FULLNAME}-envoy-client-tls"},
    }


def test_gateway_mode_takes_a_given_secret() -> None:
    docs = render({**GATEWAY, "tls": {"mode": "files", "secretName": "picker-cert"}})
    assert "--grpc-tls=files" in tls_args(docs)
    [tls_volume] = [v for v in picker(docs)["volumes"] if v["name"] == "tls"]
    assert tls_volume["secret"]["secretName"] == "picker-cert"
    assert not [d for d in docs if d["kind"] == "Certificate"]


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        pytest.param({"mode": "mtls"}, "tls.mode mtls needs the certificate", id="no-cert"),
        pytest.param(
            {"mode": "files", "certManager": {"enabled": True}}, "issuerRef.name", id="no-issuer"
        ),
    ],
)
def test_tls_without_a_certificate_fails_with_what_to_set(
    tls: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render({"tls": tls})


@pytest.mark.parametrize("mode", ["off", "self-signed", "files", "mtls"])
def test_standalone_envoy_bootstrap_matches_the_mode_and_validates(
    mode: str, tmp_path: Path
) -> None:
    config = envoy_config({"tls": {"mode": mode, "secretName": "s", "envoyClientSecretName": "c"}})
    socket = clusters(config)["extproc"].get("transport_socket")
    if mode == "off":
        assert socket is None
    else:
        context = socket["typed_config"]
        assert context["sni"] == f"{FULLNAME}.llm.svc.cluster.local"
        common = context["common_tls_context"]
        assert ("validation_context" in common) == (mode != "self-signed")
        assert ("tls_certificates" in common) == (mode == "mtls")
    # The mounted files' paths, pointed at real files for Envoy to load.
    ca = CertAuthority(tmp_path)
    client = ca.issue("envoy", client=True)
    text = (
        yaml.safe_dump(config)
        .replace("/etc/envoy/extproc-ca/ca.crt", str(ca.path))
        .replace("/etc/envoy/client-tls/tls.crt", str(client.cert))
        .replace("/etc/envoy/client-tls/tls.key", str(client.key))
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    validate(path)
