"""Finding the API server: in-cluster and kubeconfig, through lightkube over real TLS to the fake
server; a token, a token file, a client certificate and an exec plugin each authenticate."""

from __future__ import annotations

import asyncio
import base64
import shutil
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube.config.kubeconfig import SingleConfig
from lightkube.resources.core_v1 import Pod as K8sPod

from extproc.datalayer.kubeconfig import (
    in_cluster_config,
    kube_config_from_file,
    load_kube_config,
    make_client,
)
from extproc.datalayer.reflector import KubeApiError, Reflector
from extproc.errors import ConfigError
from tests.datalayer.fake_kube import FakeKube, k8s_pod

PODS = "/api/v1/namespaces/ns/pods"


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (server, CA and client at once)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    out = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(out / "key.pem"), "-out", str(out / "cert.pem")],
        check=True,
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    return out / "cert.pem", out / "key.pem"


@pytest.fixture
def tls_kube(cert: tuple[Path, Path]) -> Iterator[FakeKube]:
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(*cert)
    with FakeKube(ssl_context=server_context, token="tok") as fake:
        fake.put(PODS, k8s_pod("p0"))
        yield fake


def list_names(config: SingleConfig, between: Callable[[], object] | None = None) -> list[str]:
    """List the pods in ns; with ``between``, list, call it, and list again on the same client."""

    async def go() -> list[str]:
        client = make_client(config, request_timeout_s=5)
        reflector: Reflector[K8sPod, None] = Reflector(
            client, K8sPod, namespace="ns", convert=lambda _: None, on_change=list, what="pods"
        )
        try:
            await reflector.list()
            if between is not None:
                between()
                await reflector.list()
            return sorted(reflector.items)
        finally:
            await client.close()

    return asyncio.run(go())


def write_kubeconfig(
    path: Path, cluster: dict[str, Any], user: dict[str, Any], **extra: Any
) -> Path:
    data = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "main",
        "contexts": [
            {"name": "main", "context": {"cluster": "c", "user": "u", "namespace": "llm"}},
            {"name": "other", "context": {"cluster": "c", "user": "u"}},
        ],
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        **extra,
    }
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def test_in_cluster_over_tls_rereads_the_token(
    tls_kube: FakeKube, cert: tuple[Path, Path], tmp_path: Path
) -> None:
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "ca.crt").write_bytes(cert[0].read_bytes())
    (tmp_path / "namespace").write_text("llm")
    port = tls_kube.url.rsplit(":", 1)[1]
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}
    config = load_kube_config(environ=env, service_account_dir=tmp_path)
    assert (config.cluster.server, config.namespace) == (f"https://127.0.0.1:{port}", "llm")

    def rotate(token: str) -> Callable[[], None]:
        def go() -> None:  # projected tokens rotate: the next 401 re-reads the file
            if token:
                (tmp_path / "token").write_text(token)
            else:
                (tmp_path / "token").unlink()
            tls_kube.token = token or "unknown"

        return go

    assert list_names(config, rotate("rotated")) == ["p0"]
    assert [r.authorization for r in tls_kube.requests_of("list")] == [
        "Bearer tok",
        "Bearer tok",  # answered 401
        "Bearer rotated",
    ]
    with pytest.raises(KubeApiError, match="token not found"):
        list_names(config, rotate(""))


def test_in_cluster_ipv6_host_and_missing_files(cert: tuple[Path, Path], tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}
    with pytest.raises(ConfigError, match="token or ca.crt missing"):
        in_cluster_config(env, tmp_path)
    (tmp_path / "token").write_text("tok")
    (tmp_path / "ca.crt").write_bytes(cert[0].read_bytes())
    config = in_cluster_config(env, tmp_path)
    assert (config.cluster.server, config.namespace) == ("https://[fd00::1]:6443", "default")


def test_kubeconfig_with_inline_ca_and_client_certificate(
    tls_kube: FakeKube, cert: tuple[Path, Path], tmp_path: Path
) -> None:
    cluster = {"server": tls_kube.url, "certificate-authority-data": b64(cert[0])}
    user = {
        "token": "tok",
        "client-certificate-data": b64(cert[0]),
        "client-key-data": b64(cert[1]),
    }
    config = kube_config_from_file(write_kubeconfig(tmp_path / "config", cluster, user))
    assert config.namespace == "llm"
    assert list_names(config) == ["p0"]


def test_kubeconfig_with_relative_files(
    tls_kube: FakeKube, cert: tuple[Path, Path], tmp_path: Path
) -> None:
    shutil.copy(cert[0], tmp_path / "ca.pem")
    (tmp_path / "token").write_text("tok")
    cluster = {"server": tls_kube.url, "certificate-authority": "ca.pem"}
    config = kube_config_from_file(
        write_kubeconfig(tmp_path / "config", cluster, {"tokenFile": "token"}), "other"
    )
    assert config.namespace == "default"
    assert list_names(config) == ["p0"]


def test_tls_is_verified(tls_kube: FakeKube, tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path / "config", {"server": tls_kube.url}, {"token": "tok"})
    with pytest.raises(KubeApiError, match="CERTIFICATE_VERIFY_FAILED"):
        list_names(kube_config_from_file(path))
    insecure = {"server": tls_kube.url, "insecure-skip-tls-verify": True}
    path = write_kubeconfig(tmp_path / "config", insecure, {"token": "tok"})
    assert list_names(kube_config_from_file(path)) == ["p0"]


@pytest.mark.parametrize(
    ("cluster", "user", "extra", "message"),
    [
        pytest.param({}, {"auth-provider": {"name": "oidc"}}, {}, "auth-provider not supported",
                     id="auth-provider"),
        pytest.param({"server": "127.0.0.1:6443"}, {}, {}, "not an http", id="server-no-scheme"),
        pytest.param({}, {}, {"current-context": "nope"}, "no context named 'nope'", id="no-context"),
        pytest.param({}, {}, {"current-context": ""}, "no current-context", id="no-current"),
        pytest.param({}, {}, {"clusters": []}, "no cluster named 'c'", id="no-cluster"),
        pytest.param({}, {}, {"users": []}, "no user named 'u'", id="no-user"),
        pytest.param({}, {}, {"users": [{"name": "u"}]}, "not a valid kubeconfig", id="no-user-body"),
        pytest.param(
            {"certificate-authority-data": "!!"}, {}, {}, "cannot set up the client", id="bad-ca-data"
        ),
        pytest.param(
            {"certificate-authority-data": "aGVsbG8="}, {}, {}, "cannot set up the client", id="bad-ca"
        ),
        pytest.param(
            {"certificate-authority": "missing.pem"}, {}, {}, "cannot set up the client: .*No such file",
            id="no-ca-file",
        ),
        pytest.param(
            {}, {"client-certificate-data": "aGVsbG8=", "client-key-data": "aGVsbG8="}, {},
            "cannot set up the client", id="bad-client-cert",
        ),
    ],
)  # fmt: skip
def test_kubeconfig_errors(
    tmp_path: Path,
    cluster: dict[str, Any],
    user: dict[str, Any],
    extra: dict[str, Any],
    message: str,
) -> None:
    path = write_kubeconfig(
        tmp_path / "config", {"server": "https://127.0.0.1:6443"} | cluster, user, **extra
    )
    with pytest.raises(ConfigError, match=message):
        kube_config_from_file(path)


def test_kubeconfig_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        kube_config_from_file(tmp_path / "missing")
    (tmp_path / "list").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a kubeconfig"):
        kube_config_from_file(tmp_path / "list")


def test_resolution_order(
    cert: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def config_at(name: str, server: str) -> Path:
        return write_kubeconfig(tmp_path / name, {"server": server}, {})

    explicit = config_at("explicit", "http://127.0.0.1:1")
    from_env = config_at("env", "http://127.0.0.1:2")
    (tmp_path / "home" / ".kube").mkdir(parents=True)
    config_at("home/.kube/config", "http://127.0.0.1:3")
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("tok")
    (sa / "ca.crt").write_bytes(cert[0].read_bytes())
    in_cluster = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    def server(path: str | None, env: dict[str, str]) -> str:
        return load_kube_config(path, environ=env, service_account_dir=sa).cluster.server

    kubeconfig_env = {"KUBECONFIG": f"{tmp_path / 'absent'}:{from_env}"} | in_cluster
    assert server(str(explicit), kubeconfig_env) == "http://127.0.0.1:1"
    assert server(None, kubeconfig_env) == "http://127.0.0.1:2"
    assert server(None, in_cluster) == "https://10.96.0.1:443"
    assert server(None, {}) == "http://127.0.0.1:3"
    monkeypatch.setenv("HOME", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="no Kubernetes API server"):
        server(None, {})


EXEC_PLUGIN = """\
import json, os, pathlib, sys
with open(os.environ["CALLS_FILE"], "a") as calls:
    calls.write("run\\n")
token = pathlib.Path(sys.argv[1]).read_text()
if token == "fail":
    sys.exit("no credentials: log in first")
print(json.dumps({
    "apiVersion": "client.authentication.k8s.io/v1beta1",
    "kind": "ExecCredential",
    "status": {"token": token},
}))
"""


def test_exec_plugin_token_authenticates(
    tls_kube: FakeKube, cert: tuple[Path, Path], tmp_path: Path
) -> None:
    """As EKS's ``aws eks get-token`` or kubelogin (OIDC): the plugin's token is sent, and
    the plugin runs again when the server refuses the token it gave before."""
    (tmp_path / "plugin.py").write_text(EXEC_PLUGIN)
    (tmp_path / "issued").write_text("tok")
    calls = tmp_path / "calls"
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": sys.executable,
            "args": [str(tmp_path / "plugin.py"), str(tmp_path / "issued")],
            "env": [{"name": "CALLS_FILE", "value": str(calls)}],
        }
    }
    cluster = {"server": tls_kube.url, "certificate-authority-data": b64(cert[0])}
    config = kube_config_from_file(write_kubeconfig(tmp_path / "config", cluster, user))

    def expire() -> None:
        (tmp_path / "issued").write_text("new")
        tls_kube.token = "new"

    assert list_names(config, expire) == ["p0"]
    assert [r.authorization for r in tls_kube.requests_of("list")] == [
        "Bearer tok",
        "Bearer tok",  # answered 401
        "Bearer new",
    ]
    assert calls.read_text() == "run\n" * 2
    (tmp_path / "issued").write_text("fail")
    with pytest.raises(KubeApiError, match="returned 1: no credentials: log in first"):
        list_names(config)
