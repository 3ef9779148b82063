"""Through real Envoy with TLS and mutual TLS on extproc's gRPC port (``--grpc-tls``):
routing, retries and recording work; clients without a good certificate, and plaintext
clients, are refused and cannot write into the prefix index; the certificate files are
rotated while requests flow."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509

from e2e.support import MODEL, PREFIX_CONFIG, RECORDED, background_load, metric, unique_prefix
from extproc.sim.launch import SimPods, Stack, run_stack
from testkit.tls_certs import CertAuthority, Issued, served_certificate
from testkit.waiting import wait_until
from testkit.wire import Client, log_entry


class Certs:
    def __init__(self, directory: Path) -> None:
        self.ca = CertAuthority(directory, "cluster")
        self.server = self.ca.issue("extproc")
        self.envoy = self.ca.issue("envoy", client=True)
        self.expired = self.ca.issue("old-envoy", client=True, expired=True)
        self.stranger = CertAuthority(directory, "stranger").issue(
            "envoy", client=True, to=directory / "stranger-envoy"
        )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return Certs(tmp_path_factory.mktemp("certs"))


def serve_args(mode: str, certs: Certs) -> list[str]:
    args = ["--grpc-tls", mode]
    if mode == "self-signed":
        return args
    args += ["--tls-cert-file", str(certs.server.cert), "--tls-key-file", str(certs.server.key)]
    if mode == "mtls":
        args += ["--tls-client-ca-file", str(certs.ca.path)]
    return args


def envoy_tls(mode: str, certs: Certs) -> dict[str, object]:
    if mode == "self-signed":  # encrypted, not verified: as gateways treat a picker
        return {"extproc_tls": True}
    options: dict[str, object] = {"extproc_tls": True, "extproc_ca_file": str(certs.ca.path)}
    if mode == "mtls":
        options["extproc_client_cert_file"] = str(certs.envoy.cert)
        options["extproc_client_key_file"] = str(certs.envoy.key)
    return options


@contextmanager
def tls_stack(mode: str, sim: SimPods, certs: Certs) -> Iterator[Stack]:
    with run_stack(
        sim.as_pods(),
        config=PREFIX_CONFIG,
        extproc_args=serve_args(mode, certs),
        envoy_options=envoy_tls(mode, certs),
    ) as running:
        yield running


@pytest.fixture(scope="module")
def self_signed_stack(sim: SimPods, certs: Certs) -> Iterator[Stack]:
    with tls_stack("self-signed", sim, certs) as running:
        yield running


@pytest.fixture(scope="module")
def files_stack(sim: SimPods, certs: Certs) -> Iterator[Stack]:
    with tls_stack("files", sim, certs) as running:
        yield running


@pytest.fixture(scope="module")
def mtls_stack(sim: SimPods, certs: Certs) -> Iterator[Stack]:
    with tls_stack("mtls", sim, certs) as running:
        yield running


TLS_MODES = [pytest.param("files", id="tls"), pytest.param("mtls", id="mtls")]
ALL_TLS_MODES = [pytest.param("self-signed", id="self-signed"), *TLS_MODES]


def stack_for(request: pytest.FixtureRequest, mode: str) -> Stack:
    stack: Stack = request.getfixturevalue(f"{mode.replace('-', '_')}_stack")
    return stack


def post(stack: Stack, body: dict[str, object]) -> httpx.Response:
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        return client.post("/v1/completions", json=body)


@pytest.mark.parametrize("mode", ALL_TLS_MODES)
def test_routes_retries_and_records_over_tls(
    request: pytest.FixtureRequest, mode: str, sim: SimPods
) -> None:
    tls_stack = stack_for(request, mode)
    body = {"model": MODEL, "prompt": unique_prefix() + "question?", "max_tokens": 2}
    before = metric(tls_stack, *RECORDED)
    first = post(tls_stack, body)
    assert first.status_code == 200, first.text
    pod = first.headers["x-sim-pod"]
    wait_until(lambda: metric(tls_stack, *RECORDED) > before)
    assert [post(tls_stack, body).headers["x-sim-pod"] for _ in range(3)] == [pod] * 3
    sim.set_faults(pod, error_rate=1.0, error_status=503)
    try:
        retried = post(tls_stack, body)
    finally:
        sim.clear_faults(pod)
    assert retried.status_code == 200 and retried.headers["x-sim-pod"] != pod


def tls_client(stack: Stack, certs: Certs, identity: Issued | None) -> Client:
    """An ext_proc/access-log client over TLS trusting the CA, with ``identity``'s cert."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=certs.ca.path.read_bytes(),
        private_key=identity.key.read_bytes() if identity else None,
        certificate_chain=identity.cert.read_bytes() if identity else None,
    )
    port = stack.grpc_port
    return Client(port, grpc.secure_channel(f"127.0.0.1:{port}", credentials))


@pytest.mark.parametrize("mode", ALL_TLS_MODES)
def test_a_plaintext_client_is_refused(request: pytest.FixtureRequest, mode: str) -> None:
    tls_stack = stack_for(request, mode)
    client = Client(tls_stack.grpc_port)
    with pytest.raises(grpc.RpcError) as info:
        client.send_body({"model": MODEL, "prompt": "plain"})
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    client.channel.close()


@pytest.mark.parametrize("mode", TLS_MODES)
def test_a_client_with_the_cas_certificate_is_served(
    request: pytest.FixtureRequest, mode: str, certs: Certs
) -> None:
    tls_stack = stack_for(request, mode)
    client = tls_client(tls_stack, certs, certs.envoy)
    reply = client.send_body({"model": MODEL, "prompt": "direct"}, request_id="direct-tls")
    assert reply.dynamic_metadata.fields["envoy.lb"]
    client.channel.close()


@pytest.mark.parametrize(
    ("identity", "logged"),
    [
        pytest.param("none", "PEER_DID_NOT_RETURN_A_CERTIFICATE", id="no-certificate"),
        pytest.param("expired", "certificate has expired", id="expired"),
        pytest.param("stranger", "unable to get local issuer certificate", id="another-ca"),
    ],
)
def test_mtls_refuses_clients_without_a_good_certificate(
    mtls_stack: Stack, certs: Certs, identity: str, logged: str
) -> None:
    """No certificate, an expired one, or one from another CA: the handshake fails, so
    neither routing nor an access-log entry (a write into the prefix index) gets in; grpc
    core logs why (``Handshake failed ...``) on extproc's stderr."""
    tls_stack = mtls_stack
    chosen = {"none": None, "expired": certs.expired, "stranger": certs.stranger}[identity]
    client = tls_client(tls_stack, certs, chosen)
    before = metric(tls_stack, "extproc_completions_total", 'outcome="unknown_request"')
    recorded = metric(tls_stack, *RECORDED)
    for call in (
        lambda: client.send_body({"model": MODEL, "prompt": "intruder"}),
        lambda: client.log(log_entry("forged", "127.0.0.1:1")),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    client.channel.close()
    assert metric(tls_stack, "extproc_completions_total", 'outcome="unknown_request"') == before
    assert metric(tls_stack, *RECORDED) == recorded
    wait_until(lambda: logged in tls_stack.extproc.log_tail(50_000))


def test_certificate_rotation_while_requests_flow(files_stack: Stack, certs: Certs) -> None:
    """The Secret is updated (key first, then certificate, each replaced whole): new
    connections get the new certificate, and no request fails meanwhile."""
    tls_stack = files_stack
    old = served_certificate(tls_stack.grpc_port).serial_number
    fresh = certs.ca.issue("extproc-next", to=certs.server.cert.parent / "rotated")
    with background_load(tls_stack.url, workers=2, max_s=60) as load:
        load.wait_for_answers(20)
        for new, current in ((fresh.key, certs.server.key), (fresh.cert, certs.server.cert)):
            os.replace(new, current)
            load.wait_for_answers(load.statuses().total() + 10)
        wait_until(lambda: served_certificate(tls_stack.grpc_port).serial_number != old)
        load.wait_for_answers(load.statuses().total() + 20)
    assert set(load.statuses()) == {200}, load.statuses()
    new_serial = x509.load_pem_x509_certificate(certs.server.cert.read_bytes()).serial_number
    assert served_certificate(tls_stack.grpc_port).serial_number == new_serial
    assert "TLS files changed: new connections get the new certificate" in (
        tls_stack.extproc.log_tail(50_000)
    )
