"""extproc's mTLS refusals as Envoy meets them: one extproc (``--grpc-tls mtls``) behind
several real Envoys, each configured with another client identity towards it (the right
certificate, none, an expired one, one from another CA, or plaintext). A refused Envoy's
ext_proc call fails, so the request gets the configured failure behaviour; its access log
cannot get in either, so nothing is recorded; and extproc logs why it refused."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from e2e.support import MODEL, PREFIX_CONFIG, RECORDED, metric, unique_prefix
from e2e.test_tls import Certs, envoy_tls, serve_args
from extproc.envoyconf.options import EnvoyOptions
from extproc.sim.launch import Proc, SimPods, Stack, free_port, run_stack, start_envoy
from testkit.waiting import wait_until

# Each identity extproc refuses, and the reason it logs (grpc core's handshake failure).
REFUSED = {
    "no-certificate": "PEER_DID_NOT_RETURN_A_CERTIFICATE",
    "expired": "certificate has expired",
    "another-ca": "unable to get local issuer certificate",
    "plaintext": "WRONG_VERSION_NUMBER",
}
DECIDED = re.compile(r"^extproc_(?:route_decisions|completions)_total\{.*$", re.MULTILINE)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return Certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def mtls_stack(sim: SimPods, certs: Certs) -> Iterator[Stack]:
    """extproc in mTLS mode, and an Envoy with the right certificate (the control)."""
    with run_stack(
        sim.as_pods(),
        config=PREFIX_CONFIG,
        extproc_args=serve_args("mtls", certs),
        envoy_options=envoy_tls("mtls", certs),
    ) as running:
        yield running


def identity_options(identity: str, certs: Certs) -> dict[str, Any]:
    """Envoy's TLS options towards extproc for one refused identity."""
    if identity == "plaintext":
        return {}
    verified: dict[str, Any] = {"extproc_tls": True, "extproc_ca_file": str(certs.ca.path)}
    chosen = {"no-certificate": None, "expired": certs.expired, "another-ca": certs.stranger}
    issued = chosen[identity]
    if issued is not None:
        verified["extproc_client_cert_file"] = str(issued.cert)
        verified["extproc_client_key_file"] = str(issued.key)
    return verified


EnvoyFactory = Callable[[str, bool], str]


@pytest.fixture(scope="module")
def refused_envoy(
    sim: SimPods, certs: Certs, mtls_stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EnvoyFactory]:
    """Starts (once per identity and failure mode) an Envoy in front of the same pods and
    extproc; returns its URL. All are stopped at the module's end."""
    started: dict[tuple[str, bool], tuple[Proc, str]] = {}
    log_dir = tmp_path_factory.mktemp("envoys")

    def envoy_url(identity: str, failure_mode_allow: bool) -> str:
        key = (identity, failure_mode_allow)
        if key not in started:
            options = EnvoyOptions(
                extproc_address=f"127.0.0.1:{mtls_stack.grpc_port}",
                listen_port=free_port(),
                admin_port=free_port(),
                failure_mode_allow=failure_mode_allow,
                **identity_options(identity, certs),
            )
            name = f"envoy-{identity}-{'allow' if failure_mode_allow else 'deny'}"
            proc = start_envoy(sim.as_pods(), options, log_dir, name=name)
            started[key] = (proc, f"http://127.0.0.1:{options.listen_port}")
        return started[key][1]

    try:
        yield envoy_url
    finally:
        for proc, _ in started.values():
            proc.stop()


def decided(stack: Stack) -> list[str]:
    """Every sample of extproc's route decisions and completions (each outcome): what it
    routed and what it recorded."""
    return DECIDED.findall(stack.metrics_text())


def refusals(stack: Stack, reason: str) -> int:
    """How many times extproc's log (all of it) gives ``reason`` for a refused handshake."""
    return stack.extproc.log_path.read_text(errors="replace").count(reason)


def post(url: str, prompt: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30) as client:
        return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})


def test_the_right_certificate_routes_and_records(mtls_stack: Stack) -> None:
    """The control: the same extproc, through an Envoy with the CA's client certificate."""
    before = metric(mtls_stack, *RECORDED)
    reply = post(mtls_stack.url, unique_prefix() + "control")
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-sim-pod"]
    wait_until(lambda: metric(mtls_stack, *RECORDED) > before)


@pytest.mark.parametrize("identity", list(REFUSED))
def test_a_refused_envoy_answers_its_failure_status_and_records_nothing(
    mtls_stack: Stack, refused_envoy: EnvoyFactory, identity: str
) -> None:
    """failure_mode_allow false: Envoy cannot open the ext_proc stream and answers 500;
    no pod is asked, nothing is recorded, and extproc logs the handshake's failure."""
    reason = REFUSED[identity]
    url = refused_envoy(identity, False)
    recorded, logged = decided(mtls_stack), refusals(mtls_stack, reason)
    reply = post(url, unique_prefix() + identity)
    assert reply.status_code == 500, (reply.status_code, reply.text)
    assert "x-sim-pod" not in reply.headers
    wait_until(lambda: refusals(mtls_stack, reason) > logged, timeout_s=10)
    assert decided(mtls_stack) == recorded


def test_a_refused_envoy_that_fails_open_forwards_unrouted(
    mtls_stack: Stack, refused_envoy: EnvoyFactory
) -> None:
    """failure_mode_allow true: the request goes on to a pod Envoy picks itself, and
    extproc still records nothing (the access log is refused too)."""
    reason = REFUSED["no-certificate"]
    url = refused_envoy("no-certificate", True)
    recorded, logged = decided(mtls_stack), refusals(mtls_stack, reason)
    reply = post(url, unique_prefix() + "fail-open")
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-sim-pod"]
    wait_until(lambda: refusals(mtls_stack, reason) > logged, timeout_s=10)
    assert decided(mtls_stack) == recorded
