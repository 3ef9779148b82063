"""TLS on the gRPC port (``--grpc-tls``): plaintext, a self-signed certificate, given
files, or mutual TLS.

``self-signed`` is the Gateway API Inference Extension's picker default: a certificate
made at start-up for gateways that skip verification (it keeps the traffic private, not
authenticated). ``files`` serves ``--tls-cert-file``/``--tls-key-file``; ``mtls`` also
requires a client certificate signed by ``--tls-client-ca-file``, for every stream on
the port (ext_proc and access log alike: an unauthenticated client cannot write into the
prefix index). The files are read again when they change (a Kubernetes Secret mount
swaps them): grpc core asks ``CertificateFiles.fetch`` before every TLS handshake, which
costs three ``stat`` calls; a new or broken pair is logged, a broken one is not served.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from extproc.errors import ConfigError

log = logging.getLogger("extproc.tls")

TLS_MODES = ("off", "self-signed", "files", "mtls")
SELF_SIGNED_DAYS = 365


@dataclass(frozen=True)
class TlsSettings:
    """``--grpc-tls`` and its files (paths; None when the mode needs none)."""

    mode: str = "off"
    cert_file: Path | None = None
    key_file: Path | None = None
    client_ca_file: Path | None = None

    def __post_init__(self) -> None:
        if self.mode not in TLS_MODES:
            raise ConfigError(
                f"--grpc-tls must be one of {', '.join(TLS_MODES)}, got {self.mode!r}"
            )
        files = self.mode in ("files", "mtls")
        if files and (self.cert_file is None or self.key_file is None):
            raise ConfigError(f"--grpc-tls {self.mode} needs --tls-cert-file and --tls-key-file")
        if self.mode == "mtls" and self.client_ca_file is None:
            raise ConfigError("--grpc-tls mtls needs --tls-client-ca-file")
        if not files and (self.cert_file or self.key_file or self.client_ca_file):
            raise ConfigError(f"--tls-*-file flags need --grpc-tls files or mtls, not {self.mode}")


def server_credentials(
    settings: TlsSettings, names: tuple[str, ...] = ()
) -> grpc.ServerCredentials | None:
    """The gRPC port's credentials (None: plaintext); ``names``: extra DNS names or IPs
    of the self-signed certificate (beyond localhost, the host name and 127.0.0.1).

    Raises:
        ConfigError: a file is missing or not a matching PEM certificate and key.
    """
    if settings.mode == "off":
        return None
    if settings.mode == "self-signed":
        cert, key = self_signed(("localhost", socket.gethostname(), "127.0.0.1", *names))
        log.info("gRPC port: TLS with a self-signed certificate made at start-up")
        return grpc.ssl_server_credentials([(key, cert)])
    assert settings.cert_file is not None and settings.key_file is not None
    files = CertificateFiles(settings.cert_file, settings.key_file, settings.client_ca_file)
    initial = files.load()
    log.info(
        "gRPC port: %s with %s (reloaded when the files change)",
        "mutual TLS, client certificates from " + str(settings.client_ca_file)
        if settings.mode == "mtls"
        else "TLS",
        settings.cert_file,
    )
    return grpc.dynamic_ssl_server_credentials(
        initial, files.fetch, require_client_authentication=settings.mode == "mtls"
    )


class CertificateFiles:
    """A certificate, its key and (mTLS) the client CA, re-read when they change."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None) -> None:
        self._paths = (cert, key, *([client_ca] if client_ca else []))
        self._lock = threading.Lock()
        self._seen: tuple[tuple[int, int, int], ...] | None = None

    def _stamp(self) -> tuple[tuple[int, int, int], ...]:
        stats = [os.stat(p) for p in self._paths]  # follows the Secret mount's symlinks
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in stats)

    def load(self) -> grpc.ServerCertificateConfiguration:
        """Read and check the files now.

        Raises:
            ConfigError: unreadable, not PEM, or a key that is not the certificate's.
        """
        stamp = self._stamp_or_error()
        try:
            data = [p.read_bytes() for p in self._paths]
        except OSError as exc:
            raise ConfigError(f"cannot read a TLS file: {exc}") from None
        cert_pem, key_pem = data[0], data[1]
        cert = _check_pair(cert_pem, key_pem, self._paths[0], self._paths[1])
        if len(data) > 2:
            _check_certificates(data[2], self._paths[2])
        self._seen = stamp
        _log_validity(cert, self._paths[0])
        return grpc.ssl_server_certificate_configuration(
            [(key_pem, cert_pem)], root_certificates=data[2] if len(data) > 2 else None
        )

    def _stamp_or_error(self) -> tuple[tuple[int, int, int], ...]:
        try:
            return self._stamp()
        except OSError as exc:
            raise ConfigError(f"cannot read a TLS file: {exc}") from None

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc core's hook before each handshake: a new configuration when the files
        changed and hold a good pair, else None (keep serving the current one)."""
        with self._lock:
            try:
                if self._stamp() == self._seen:
                    return None
                config = self.load()
            except (ConfigError, OSError) as exc:
                try:  # mid-update (key written before the certificate): retried on the next change
                    self._seen = self._stamp()
                except OSError:
                    pass
                log.warning("TLS files changed but cannot be served (keeping the old): %s", exc)
                return None
            log.info("TLS files changed: new connections get the new certificate")
            return config


def _check_pair(
    cert_pem: bytes, key_pem: bytes, cert_path: Path, key_path: Path
) -> x509.Certificate:
    cert = _check_certificates(cert_pem, cert_path)[0]
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{key_path} is not an unencrypted PEM private key: {exc}") from None
    public = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    own = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    if public != own:
        raise ConfigError(f"{key_path} is not the key of the certificate in {cert_path}")
    return cert


def _check_certificates(pem: bytes, path: Path) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise ConfigError(f"{path} holds no PEM certificate: {exc}") from None


def _log_validity(cert: x509.Certificate, path: Path) -> None:
    now = datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc <= now:
        log.error("the certificate in %s expired at %s", path, cert.not_valid_after_utc)
    elif cert.not_valid_before_utc > now:
        log.error("the certificate in %s is not valid before %s", path, cert.not_valid_before_utc)
    else:
        log.info("serving the certificate in %s, valid until %s", path, cert.not_valid_after_utc)


def self_signed(names: tuple[str, ...], days: int = SELF_SIGNED_DAYS) -> tuple[bytes, bytes]:
    """A fresh P-256 key and a self-signed certificate for ``names`` (DNS names or IPs):
    PEM certificate, PEM key."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "extproc")])
    now = datetime.datetime.now(datetime.UTC)
    alt_names: list[x509.GeneralName] = []
    for name in dict.fromkeys(n for n in names if n):
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            alt_names.append(x509.DNSName(name))
            continue
        if not ip.is_unspecified:  # 0.0.0.0 binds every address but names none
            alt_names.append(x509.IPAddress(ip))
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
