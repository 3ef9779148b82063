"""Where the Kubernetes API server is and how to authenticate to it.

Resolution order (as client-go's, minus the plugins):

1. an explicit kubeconfig: the ``path`` argument (``--kubeconfig``) or ``$KUBECONFIG``
   (a ``:``-separated list is not merged: the first existing file is read);
2. in-cluster, when ``KUBERNETES_SERVICE_HOST`` is set: ``https://HOST:PORT`` with the
   service account's ``token`` (re-read at every request, since bound tokens rotate)
   and ``ca.crt`` under ``/var/run/secrets/kubernetes.io/serviceaccount/``;
3. ``~/.kube/config``.

A kubeconfig context may authenticate with ``token``, ``tokenFile`` or a client
certificate (``client-certificate[-data]`` + ``client-key[-data]``), and trust the server
with ``certificate-authority[-data]`` or ``insecure-skip-tls-verify``; an ``http://``
server (the tests' fake API server) uses no TLS. ``exec`` and ``auth-provider`` plugins
and basic auth are refused with a ``ConfigError``: get a token
(``kubectl create token SA``) or run in-cluster instead.
"""

from __future__ import annotations

import base64
import binascii
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from extproc.errors import ConfigError

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = Path("~/.kube/config")
DEFAULT_NAMESPACE = "default"


@dataclass(frozen=True, slots=True, eq=False)
class KubeConfig:
    """One API server endpoint and its credentials."""

    server: str  # "https://host:port", no trailing slash
    namespace: str = DEFAULT_NAMESPACE  # the context's (or service account's) namespace
    token: str | None = None
    token_file: Path | None = None  # read at every request: projected tokens rotate
    ssl_context: ssl.SSLContext | None = None  # None: plain http, or the system trust
    source: str = ""  # "in-cluster" or "kubeconfig PATH (context C)", for messages

    def authorization(self) -> str | None:
        """The ``Authorization`` header value, or None without a token.

        Raises:
            ConfigError: the token file cannot be read.
        """
        token = self.token
        if self.token_file is not None:
            try:
                token = self.token_file.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(f"{self.source}: cannot read token: {exc}") from exc
        return f"Bearer {token}" if token else None


def load_kube_config(
    path: str | None = None,
    context: str | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> KubeConfig:
    """Find the API server: explicit kubeconfig, then in-cluster, then ``~/.kube/config``.

    Args:
        path: a kubeconfig file (``--kubeconfig``); None to follow the order above.
        context: the kubeconfig context; None for its ``current-context``.
        environ: the environment (tests pass their own).
        service_account_dir: where the in-cluster token, CA and namespace are.

    Raises:
        ConfigError: nothing found, or the file or its chosen context is unusable.
    """
    explicit = path or next(
        (p for p in environ.get("KUBECONFIG", "").split(os.pathsep) if p and Path(p).exists()),
        None,
    )
    if explicit:
        return kube_config_from_file(Path(explicit), context)
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster_config(environ, service_account_dir)
    home = DEFAULT_KUBECONFIG.expanduser()
    if home.exists():
        return kube_config_from_file(home, context)
    raise ConfigError(
        "no Kubernetes API server: not in a cluster (KUBERNETES_SERVICE_HOST unset), "
        f"no --kubeconfig or $KUBECONFIG, and no {home}"
    )


def in_cluster_config(
    environ: Mapping[str, str] = os.environ, service_account_dir: Path = SERVICE_ACCOUNT_DIR
) -> KubeConfig:
    """The pod's service account: token, CA and namespace from ``service_account_dir``."""
    host = environ.get("KUBERNETES_SERVICE_HOST", "")
    port = environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:  # IPv6
        host = f"[{host}]"
    token_file = service_account_dir / "token"
    ca_file = service_account_dir / "ca.crt"
    source = f"in-cluster ({service_account_dir})"
    if not token_file.is_file() or not ca_file.is_file():
        raise ConfigError(f"{source}: token or ca.crt missing; is a service account mounted?")
    try:
        namespace = (service_account_dir / "namespace").read_text(encoding="utf-8").strip()
    except OSError:
        namespace = DEFAULT_NAMESPACE
    return KubeConfig(
        server=f"https://{host}:{port}",
        namespace=namespace or DEFAULT_NAMESPACE,
        token_file=token_file,
        ssl_context=_ssl_context(source, ca_file=str(ca_file)),
        source=source,
    )


def kube_config_from_file(path: Path, context: str | None = None) -> KubeConfig:
    """Read one context of a kubeconfig file (relative file names are relative to it)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"kubeconfig {path}: cannot read: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"kubeconfig {path}: not a kubeconfig mapping")
    name = context or data.get("current-context")
    if not name:
        raise ConfigError(f"kubeconfig {path}: no current-context; pass --kube-context")
    source = f"kubeconfig {path} (context {name})"
    ctx = _named(data, "contexts", "context", name, source)
    cluster = _named(data, "clusters", "cluster", ctx.get("cluster"), source)
    user = _named(data, "users", "user", ctx.get("user"), source) if ctx.get("user") else {}
    if refused := sorted({"exec", "auth-provider", "username"} & set(user)):
        raise ConfigError(
            f"{source}: user authentication {refused} is not supported; use a token "
            "(kubectl create token SA), a client certificate, or run in-cluster"
        )
    server = str(cluster.get("server", "")).rstrip("/")
    if not server.startswith(("https://", "http://")):
        raise ConfigError(f"{source}: cluster server {server!r} is not an http(s) URL")
    base = path.parent
    token_file = user.get("tokenFile")
    return KubeConfig(
        server=server,
        namespace=str(ctx.get("namespace") or DEFAULT_NAMESPACE),
        token=user.get("token"),
        token_file=base / token_file if token_file else None,
        ssl_context=(
            _kubeconfig_ssl(cluster, user, base, source) if server.startswith("https:") else None
        ),
        source=source,
    )


def _named(data: Mapping[str, Any], section: str, key: str, name: object, source: str) -> Any:
    for entry in data.get(section) or ():
        if isinstance(entry, Mapping) and entry.get("name") == name:
            value = entry.get(key)
            if isinstance(value, Mapping):
                return value
    raise ConfigError(f"{source}: no {key} named {name!r} in {section}")


def _kubeconfig_ssl(
    cluster: Mapping[str, Any], user: Mapping[str, Any], base: Path, source: str
) -> ssl.SSLContext:
    def file_or_data(section: Mapping[str, Any], key: str) -> tuple[str | None, bytes | None]:
        """``KEY-data`` (base64 PEM, wins as in kubectl) or ``KEY`` (a file name)."""
        if data := section.get(f"{key}-data"):
            try:
                return None, base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ConfigError(f"{source}: {key}-data is not base64: {exc}") from None
        name = section.get(key)
        return (str(base / name) if name else None), None

    ca_file, ca_data = file_or_data(cluster, "certificate-authority")
    context = _ssl_context(
        source,
        ca_file=ca_file,
        ca_data=ca_data.decode("ascii", "replace") if ca_data else None,
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
    )
    cert_file, cert_data = file_or_data(user, "client-certificate")
    key_file, key_data = file_or_data(user, "client-key")
    if (cert_file or cert_data) and (key_file or key_data):
        _load_client_cert(context, cert_file, cert_data, key_file, key_data, source)
    return context


def _ssl_context(
    source: str,
    *,
    ca_file: str | None = None,
    ca_data: str | None = None,
    insecure: bool = False,
) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=ca_file, cadata=ca_data)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{source}: cannot load the certificate authority: {exc}") from exc
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _load_client_cert(
    context: ssl.SSLContext,
    cert_file: str | None,
    cert_data: bytes | None,
    key_file: str | None,
    key_data: bytes | None,
    source: str,
) -> None:
    # ssl loads certificates only from files: inline data goes through a private temp dir.
    with tempfile.TemporaryDirectory(prefix="extproc-kube-") as tmp:
        if cert_data is not None:
            cert_file = os.path.join(tmp, "client.crt")
            Path(cert_file).write_bytes(cert_data)
        if key_data is not None:
            key_file = os.path.join(tmp, "client.key")
            Path(key_file).write_bytes(key_data)
        try:
            context.load_cert_chain(str(cert_file), str(key_file))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{source}: cannot load the client certificate: {exc}") from exc
