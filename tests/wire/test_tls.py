"""TLS on the gRPC port, on both servers: the modes, the checks of the files at start,
and their reload when they change."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from prometheus_client import CollectorRegistry

from extproc.errors import ConfigError
from extproc.routing.router import Router
from extproc.wire.server import make_grpc_server
from extproc.wire.tls import CertificateFiles, TlsSettings, server_credentials
from testkit.factories import PREFIX_ONLY, make_scheduler
from testkit.tls_certs import CertAuthority, Issued, served_certificate
from testkit.wire import PODS, Client, destination


@pytest.fixture
def ca(tmp_path: Path) -> CertAuthority:
    return CertAuthority(tmp_path)


@contextmanager
def serve(settings: TlsSettings, kind: str) -> Iterator[int]:
    router = Router(make_scheduler(PREFIX_ONLY), PODS, registry=CollectorRegistry())
    server, port = make_grpc_server(
        router, "127.0.0.1:0", server_kind=kind, credentials=server_credentials(settings)
    )
    server.start()
    try:
        yield port
    finally:
        server.stop(0).wait(5)


def secure_client(port: int, root: bytes, identity: Issued | None = None) -> Client:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=root,
        private_key=identity.key.read_bytes() if identity else None,
        certificate_chain=identity.cert.read_bytes() if identity else None,
    )
    options = [("grpc.ssl_target_name_override", "extproc")]
    return Client(port, grpc.secure_channel(f"127.0.0.1:{port}", credentials, options))


def routes(client: Client) -> bool:
    try:
        return bool(destination(client.send_body({"model": "m", "prompt": "p"})))
    except grpc.RpcError:
        return False
    finally:
        client.channel.close()


def test_self_signed_serves_tls_and_refuses_plaintext(server_kind: str) -> None:
    with serve(TlsSettings("self-signed"), server_kind) as port:
        assert not routes(Client(port))
        certificate = served_certificate(port).public_bytes(
            serialization.Encoding.PEM
        )  # what a verifying client would pin
        client = Client(
            port,
            grpc.secure_channel(
                f"localhost:{port}", grpc.ssl_channel_credentials(root_certificates=certificate)
            ),
        )
        assert routes(client)


def test_mtls_serves_only_clients_with_a_certificate_from_the_ca(
    ca: CertAuthority, tmp_path: Path, server_kind: str
) -> None:
    server = ca.issue("extproc")
    settings = TlsSettings("mtls", server.cert, server.key, ca.path)
    other = CertAuthority(tmp_path, "other").issue("c", client=True, to=tmp_path / "other-c")
    with serve(settings, server_kind) as port:
        root = ca.path.read_bytes()
        assert routes(secure_client(port, root, ca.issue("envoy", client=True)))
        assert not routes(secure_client(port, root))
        assert not routes(secure_client(port, root, other))
        assert not routes(secure_client(port, root, ca.issue("old", client=True, expired=True)))
        assert not routes(Client(port))


def test_files_are_read_again_when_they_change_and_a_broken_pair_is_not_served(
    ca: CertAuthority, caplog: pytest.LogCaptureFixture
) -> None:
    server = ca.issue("extproc")
    files = CertificateFiles(server.cert, server.key, None)
    files.load()
    assert files.fetch() is None  # unchanged: keep serving
    fresh = ca.issue("extproc-next", to=server.cert.parent / "next")
    with caplog.at_level(logging.INFO, "extproc.tls"):
        os.replace(fresh.key, server.key)  # the key first: no longer the certificate's
        assert files.fetch() is None
        assert "cannot be served (keeping the old)" in caplog.text
        os.replace(fresh.cert, server.cert)
        assert files.fetch() is not None
        assert "new connections get the new certificate" in caplog.text
    assert files.fetch() is None


@pytest.mark.parametrize(
    ("mode", "files", "message"),
    [
        pytest.param("bogus", (), "--grpc-tls must be one of", id="unknown-mode"),
        pytest.param("files", (), "needs --tls-cert-file and --tls-key-file", id="files-without"),
        pytest.param("mtls", ("cert", "key"), "needs --tls-client-ca-file", id="mtls-without-ca"),
        pytest.param("off", ("cert", "key"), "need --grpc-tls files or mtls", id="files-unused"),
    ],
)
def test_settings_that_cannot_work_are_refused(
    mode: str, files: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    paths = [tmp_path / name for name in files]
    with pytest.raises(ConfigError, match=message):
        TlsSettings(mode, *paths)


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        pytest.param("missing", "cannot read a TLS file", id="missing-file"),
        pytest.param("not-pem", "holds no PEM certificate", id="not-pem"),
        pytest.param("other-key", "is not the key of the certificate", id="other-key"),
    ],
)
def test_bad_files_stop_the_start_with_a_clear_message(
    ca: CertAuthority, break_it: str, message: str
) -> None:
    server = ca.issue("extproc")
    if break_it == "missing":
        server.key.unlink()
    elif break_it == "not-pem":
        server.cert.write_text("not a certificate")
    else:
        server.key.write_bytes(ca.issue("else", to=server.cert.parent / "else").key.read_bytes())
    with pytest.raises(ConfigError, match=message):
        server_credentials(TlsSettings("files", server.cert, server.key))


def test_an_expired_serving_certificate_is_logged_at_start(
    ca: CertAuthority, caplog: pytest.LogCaptureFixture
) -> None:
    """Clients will refuse it; the picker's log says why before they do."""
    server = ca.issue("extproc", expired=True)
    with caplog.at_level(logging.INFO, "extproc.tls"):
        server_credentials(TlsSettings("files", server.cert, server.key))
    [record] = [r for r in caplog.records if "expired at" in r.getMessage()]
    assert record.levelno == logging.ERROR and str(server.cert) in record.getMessage()
