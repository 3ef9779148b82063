"""The generated Envoy configuration's knobs (``EnvoyOptions``) and their checks: each
value is refused at construction, naming it, before anything is built from it
(``envoyconf.build``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from extproc.datalayer.pods_file import parse_address
from extproc.request.parse import DEFAULT_MAX_BODY_BYTES
from extproc.wire.protocol import FAIRNESS_HEADER, OBJECTIVE_HEADER

_HEADER_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")  # lowercase, and safe inside CEL quotes
_DNS_NAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+")

# How long Envoy waits for the body reply. It covers sending the body to extproc and
# routing it, and concurrent large bodies queue for the one Python process, so it stays
# above the worst round measured for the largest bodies on a loaded machine
# (bench/results/ext_proc_round.md). A hung extproc holds each request this long before
# the 504 or the round-robin fallback; a dead one is answered at once.
DEFAULT_MESSAGE_TIMEOUT_S = 10.0

# The longest message timeout extproc may ask for (override_message_timeout) while flow
# control holds a request: the longest time to live in its queue plus a margin must fit
# under it, or Envoy ignores the override and answers 504 at message_timeout.
DEFAULT_MAX_MESSAGE_TIMEOUT_S = 60.0

# The share of requests Envoy traces when its tracing is on (``otlp_endpoint``): extproc's
# span follows Envoy's decision (its sampler is parent-based), so this sets both.
DEFAULT_TRACE_SAMPLING = 0.01

# Request headers extproc reads: the session, and flow control's objective and fairness key.
DEFAULT_ATTRIBUTE_HEADERS = ("x-session-id", OBJECTIVE_HEADER, FAIRNESS_HEADER)


@dataclass(frozen=True, slots=True)
class EnvoyOptions:
    """The knobs of the generated Envoy configuration.

    Attributes:
        extproc_address: extproc's gRPC server (ext_proc and access log), ip:port or
            dns-name:port (e.g. a Kubernetes Service; then the cluster is STRICT_DNS);
            several replicas comma-separated (``extproc_addresses``), balanced round
            robin, a replica that refuses connections ejected for a while.
        listen_address: the listener's IP.
        listen_port: the listener's port.
        admin_port: admin interface port (always on 127.0.0.1).
        num_fallbacks: retries after the first pod, one per listed fallback pod.
        failure_mode_allow: when extproc is down or slow, False answers 500 (down) or
            504 (message timeout); True forwards the request to a round-robin pod.
        message_timeout_s: how long Envoy waits for the body reply (includes sending
            the body to extproc: keep it above a max-size body's transfer time).
        max_message_timeout_s: the longest wait extproc may ask for per request
            (``override_message_timeout``, sent while flow control holds a request);
            Envoy ignores a longer one. Keep it above the longest queue time to live
            plus two seconds.
        max_body_bytes: largest request body; the listener's per-connection buffer,
            the buffer filter and ext_proc's BUFFERED mode all hold the whole body.
        connect_timeout_s: TCP connect timeout for pods and extproc.
        attribute_headers: request headers sent to extproc as attributes (lowercase),
            see ``header_attribute``; flow control's are among the defaults.
        pods_dns: ``dns-name:port`` whose addresses are the pods (in Kubernetes a
            headless Service); replaces the static pod list with a STRICT_DNS cluster
            that follows the pods as DNS does.
        extproc_tls: TLS towards extproc (``extproc serve --grpc-tls`` not off).
        extproc_ca_file: CA bundle that verifies extproc's certificate; None with TLS:
            not verified (extproc's ``self-signed`` mode: private, not authenticated).
        extproc_sni: the server name sent and (with a CA) verified; default: the host
            of ``extproc_address``.
        extproc_client_cert_file, extproc_client_key_file: Envoy's client certificate
            (extproc's ``mtls`` mode).
        otlp_endpoint: ``host:port`` of an OpenTelemetry collector's OTLP gRPC port: Envoy
            traces requests (``envoy.tracers.opentelemetry``) and exports its spans
            there; its trace context reaches extproc with each ext_proc stream, so
            extproc's pick span (``serve --otlp-endpoint``) joins Envoy's trace. None:
            no tracing.
        trace_sampling: the share of requests traced, 0 to 1 (Envoy's random_sampling).
    """

    extproc_address: str = "127.0.0.1:9002"
    listen_address: str = "127.0.0.1"
    listen_port: int = 10000
    admin_port: int = 9901
    num_fallbacks: int = 2
    failure_mode_allow: bool = False
    message_timeout_s: float = DEFAULT_MESSAGE_TIMEOUT_S
    max_message_timeout_s: float = DEFAULT_MAX_MESSAGE_TIMEOUT_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    connect_timeout_s: float = 1.0
    attribute_headers: tuple[str, ...] = DEFAULT_ATTRIBUTE_HEADERS
    pods_dns: str | None = None
    extproc_tls: bool = False
    extproc_ca_file: str | None = None
    extproc_sni: str | None = None
    extproc_client_cert_file: str | None = None
    extproc_client_key_file: str | None = None
    otlp_endpoint: str | None = None
    trace_sampling: float = DEFAULT_TRACE_SAMPLING

    def __post_init__(self) -> None:
        _ = self.extproc_addresses  # raises on a bad address
        if self.otlp_endpoint is not None:
            split_host_port(self.otlp_endpoint)  # raises on a bad address
        if not 0 <= self.trace_sampling <= 1:
            raise ValueError(f"trace_sampling must be in [0, 1], got {self.trace_sampling}")
        tls_files = (
            self.extproc_ca_file,
            self.extproc_sni,
            self.extproc_client_cert_file,
            self.extproc_client_key_file,
        )
        if not self.extproc_tls and any(tls_files):
            raise ValueError("extproc TLS files and SNI need extproc_tls (--extproc-tls)")
        if (self.extproc_client_cert_file is None) != (self.extproc_client_key_file is None):
            raise ValueError("the client certificate for extproc needs both its cert and key")
        if self.pods_dns is not None and split_host_port(self.pods_dns)[2]:
            raise ValueError(f"pods_dns must be dns-name:port, got {self.pods_dns!r}")
        for name in ("listen_port", "admin_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"{name} must be 1-65535, got {getattr(self, name)}")
        if self.num_fallbacks < 0:
            raise ValueError(f"num_fallbacks must be >= 0, got {self.num_fallbacks}")
        if self.message_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_message_timeout_s < self.message_timeout_s:
            raise ValueError(
                f"max_message_timeout_s ({self.max_message_timeout_s}) must be at least "
                f"message_timeout_s ({self.message_timeout_s})"
            )
        if not 0 < self.max_body_bytes < 1 << 32:
            raise ValueError(f"max_body_bytes must be 1 .. 2**32-1, got {self.max_body_bytes}")
        for name in self.attribute_headers:
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"attribute header {name!r} must be a lowercase header name")

    @property
    def extproc_addresses(self) -> list[tuple[str, int, bool]]:
        """``extproc_address`` split at commas, each as ``split_host_port`` returns it."""
        parts = [a.strip() for a in self.extproc_address.split(",")]
        if not all(parts):
            raise ValueError(f"extproc address list {self.extproc_address!r} has an empty entry")
        return [split_host_port(a) for a in parts]


def split_host_port(address: str) -> tuple[str, int, bool]:
    """Split ``ip:port``, ``[v6]:port`` or ``dns-name:port``.

    Returns:
        host (IPv6 without brackets), port, and whether the host is an IP address.

    Raises:
        ValueError: neither form, or a bad port.
    """
    try:
        host, _, port = parse_address(address).rpartition(":")
        return host.strip("[]"), int(port), True
    except ValueError as exc:
        host, _, port = address.rpartition(":")
        if not _DNS_NAME.fullmatch(host) or host.replace(".", "").isdigit():
            raise exc from None
        if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(
                f"address {address!r}: port must be an integer from 1 to 65535"
            ) from None
        return host, int(port), False
