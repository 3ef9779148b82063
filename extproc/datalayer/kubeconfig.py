"""Where the Kubernetes API server is and how to authenticate to it, as a lightkube config.

The client is lightkube's ``AsyncClient`` rather than kubernetes_asyncio: typed models, an
async watch that yields ``(type, object)``, custom resources through
``lightkube.generic_resource``, and a small install instead of a large generated one.

Resolution order (as client-go's):

1. an explicit kubeconfig: the ``path`` argument (``--kubeconfig``) or ``$KUBECONFIG``
   (a ``:``-separated list is not merged: the first existing file is read);
2. in-cluster, when ``KUBERNETES_SERVICE_HOST`` is set: ``https://HOST:PORT`` with the
   service account's ``token`` (lightkube re-reads it after a 401, since bound tokens
   rotate), ``ca.crt`` and ``namespace`` under
   ``/var/run/secrets/kubernetes.io/serviceaccount/``;
3. ``~/.kube/config``.

Through lightkube a kubeconfig user may authenticate with ``token``, ``tokenFile``, a client
certificate (``client-certificate[-data]`` + ``client-key[-data]``), basic auth, or an
``exec`` credential plugin of API ``client.authentication.k8s.io/v1beta1`` (or
``v1alpha1``) that prints a token, as EKS (``aws eks get-token``), GKE
(``gke-gcloud-auth-plugin``) and OIDC (``kubelogin``) kubeconfigs use; the plugin runs
again when the server answers 401. The server is trusted with
``certificate-authority[-data]`` or ``insecure-skip-tls-verify``. The legacy
``auth-provider`` plugins (``oidc``, ``gcp``, ``azure``) are refused with a
``ConfigError``: use the exec form of the same login.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import httpx2
import msgspec
import yaml
from lightkube import AsyncClient
from lightkube import ConfigError as LightkubeConfigError
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.config.models import Cluster, User

from extproc.errors import ConfigError
from extproc.pods import DEFAULT_NAMESPACE

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = Path("~/.kube/config")

IN_CLUSTER = "in-cluster"  # the context name of an in-cluster config


def load_kube_config(
    path: str | None = None,
    context: str | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> SingleConfig:
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
) -> SingleConfig:
    """The pod's service account: token, CA and namespace from ``service_account_dir``.

    Not lightkube's ``from_service_account``: that one needs the ``namespace`` file and
    ``KUBERNETES_SERVICE_PORT`` and reads ``os.environ``.
    """
    host = environ.get("KUBERNETES_SERVICE_HOST", "")
    port = environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:  # IPv6
        host = f"[{host}]"
    token_file = service_account_dir / "token"
    ca_file = service_account_dir / "ca.crt"
    if not token_file.is_file() or not ca_file.is_file():
        raise ConfigError(
            f"in-cluster ({service_account_dir}): token or ca.crt missing; "
            "is a service account mounted?"
        )
    try:
        namespace = (service_account_dir / "namespace").read_text(encoding="utf-8").strip()
    except OSError:
        namespace = ""
    config = KubeConfig.from_one(
        cluster=Cluster(server=f"https://{host}:{port}", certificate_auth=str(ca_file)),
        user=User(token_file=str(token_file)),
        context_name=IN_CLUSTER,
        namespace=namespace or DEFAULT_NAMESPACE,
    ).get()
    assert config is not None  # from_one sets the current context
    return _checked(config, f"in-cluster ({service_account_dir})")


def kube_config_from_file(path: Path, context: str | None = None) -> SingleConfig:
    """Read one context of a kubeconfig file (relative file names are relative to it)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"kubeconfig {path}: cannot read: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"kubeconfig {path}: not a kubeconfig mapping")
    name = context or data.get("current-context")
    if not name:
        raise ConfigError(f"kubeconfig {path}: no current-context; pass --kube-context")
    source = f"kubeconfig {path} (context {name})"
    try:
        kubeconfig = KubeConfig.from_dict(
            {"clusters": [], "contexts": [], **data}, fname=path.absolute()
        )
    except (KeyError, TypeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"{source}: not a valid kubeconfig: {exc!r}") from exc
    if (ctx := kubeconfig.contexts.get(name)) is None:
        raise ConfigError(f"{source}: no context named {name!r} in contexts")
    if ctx.cluster not in kubeconfig.clusters:
        raise ConfigError(f"{source}: no cluster named {ctx.cluster!r} in clusters")
    if ctx.user is not None and ctx.user not in kubeconfig.users:
        raise ConfigError(f"{source}: no user named {ctx.user!r} in users")
    config = kubeconfig.get(name)
    assert config is not None  # get() returns None only for a missing name with a default
    if config.user is not None and config.user.token_file is not None:
        # kubectl reads a relative tokenFile beside the kubeconfig; lightkube from the cwd
        token_file = str(config.abs_file(config.user.token_file))
        config = config._replace(user=msgspec.structs.replace(config.user, token_file=token_file))
    return _checked(config, source)


def describe(config: SingleConfig) -> str:
    """Where a config came from, for messages."""
    if config.fname is not None:
        return f"kubeconfig {config.fname} (context {config.context_name})"
    return config.context_name


def make_client(config: SingleConfig, *, request_timeout_s: float = 10.0) -> AsyncClient:
    """A lightkube client whose watches ask for bookmarks.

    Raises:
        ConfigError: the credentials or certificates cannot be loaded.
    """
    # lightkube refuses a context without a user; kubectl sends no credentials then.
    if config.user is None:
        config = config._replace(user=User())
    try:
        client = AsyncClient(
            config, timeout=httpx2.Timeout(request_timeout_s), lazy=False, trust_env=True
        )
    except (LightkubeConfigError, OSError, ValueError) as exc:
        # ssl.SSLError is an OSError; bad base64 certificate data a binascii.Error (ValueError)
        raise ConfigError(f"{describe(config)}: cannot set up the client: {exc}") from exc
    _ask_for_bookmarks(client)
    return client


def _checked(config: SingleConfig, source: str) -> SingleConfig:
    """Fail now, with the source named, on what lightkube would only find when connecting."""
    server = config.cluster.server.rstrip("/")
    if not server.startswith(("https://", "http://")):
        raise ConfigError(f"{source}: cluster server {server!r} is not an http(s) URL")
    make_client(config)  # loads the certificates; holds no connection, so nothing to close
    return config


def _ask_for_bookmarks(client: AsyncClient) -> None:
    """Add ``allowWatchBookmarks=true`` to watch requests, which lightkube cannot ask for.

    Bookmarks move a quiet watch's resourceVersion on, so resuming it after etcd compacted
    its history does not end in 410 Gone and a full list. This reaches into lightkube's
    httpx client (private); without it the watch works the same, only with more re-lists.
    """
    http = getattr(getattr(client, "_client", None), "_client", None)
    if not isinstance(http, httpx2.AsyncClient):
        log.info("lightkube's httpx client not found: watching without bookmarks")
        return

    async def allow_bookmarks(request: httpx2.Request) -> None:
        if request.url.params.get("watch") == "true":
            request.url = request.url.copy_set_param("allowWatchBookmarks", "true")

    http.event_hooks["request"].append(allow_bookmarks)
