"""Write generated Envoy configuration as YAML, with explanatory comments.

The structure comes only from the protobuf objects (``build``); this module adds
``#`` comment lines above chosen keys, found by the start of their line, so the
shipped ``envoy/*.yaml`` files are both generated and readable.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping
from typing import Any

import yaml
from google.protobuf import json_format, message

from extproc.envoyconf.build import OTLP_CLUSTER, Snippet

_LINE_WIDTH = 100


def to_dict(config: message.Message) -> dict[str, Any]:
    """The proto3 JSON form with Envoy's snake_case field names, as plain dicts and lists.

    (``MessageToDict`` returns ``OrderedDict`` for Any fields, which YAML's safe dumper
    refuses; going through the JSON text gives plain types with the same key order.)
    """
    data: dict[str, Any] = json.loads(
        json_format.MessageToJson(config, preserving_proto_field_name=True)
    )
    return data


def to_yaml(data: Any, *, header: str = "", comments: Mapping[str, str] | None = None) -> str:
    """YAML text of ``data`` (key order kept), with a header and per-key comments.

    Args:
        data: plain data, e.g. from ``to_dict``.
        header: a comment put first (re-flowed like the others).
        comments: maps a line's start, without indentation and a leading "- "
            (``"retry_policy:"``, ``"message_timeout:"`` for "message_timeout: 1s",
            ``"name: extproc"``) to the comment put above the first line it matches
            (the whole line, or up to a space); each must match some line.

    Returns:
        The YAML document.

    Raises:
        ValueError: a comment key matched no line.
    """
    body = yaml.safe_dump(data, sort_keys=False, width=_LINE_WIDTH)
    pending = dict(comments or {})
    lines = [_comment("", header)] if header else []
    for line in body.splitlines():
        stripped = line.lstrip(" ")
        key = stripped.removeprefix("- ")
        for anchor, text in pending.items():
            if key == anchor or key.startswith(anchor + " "):
                lines.append(_comment(line[: len(line) - len(stripped)], text))
                del pending[anchor]
                break
        lines.append(line)
    if pending:
        raise ValueError(f"comments for lines not in the YAML: {sorted(pending)}")
    return "\n".join(lines) + "\n"


def _comment(indent: str, text: str) -> str:
    """``text`` re-flowed as one paragraph into "# " lines that end by column 100."""
    width = max(_LINE_WIDTH - len(indent) - 2, 40)
    return "\n".join(f"{indent}# {part}" for part in textwrap.wrap(text, width))


# --- the shipped files: comments keyed by the line they sit above ---------------------

_EXT_PROC = """\
extproc picks the pod. One gRPC message round per request: Envoy skips the request
headers and sends the whole body (BUFFERED); response headers are skipped and
response_body_mode is NONE (the default, so not written). The reply's dynamic
metadata envoy.lb/x-gateway-destination-endpoint = "ip:port,ip:port" (best first)
steers the override_host load balancer below. failure_mode_allow (written only when
true): false answers 500 when extproc is down and 504 when it does not reply within
message_timeout; true (--failure-mode-allow) sends such requests to a round-robin pod."""

_COMMON: dict[str, str] = {
    "name: envoy.filters.http.ext_proc": _EXT_PROC,
    "request_attributes:": """\
With request headers skipped these are all extproc learns besides the body; they
arrive on the body message in attributes["envoy.filters.http.ext_proc"], keyed by
the expression text (a header the client did not send is absent).""",
    "message_timeout:": """\
Time for Envoy to send the body and get the reply; keep it above a max-size body's
transfer plus extproc's worst parse time.""",
    "max_message_timeout:": """\
The longest message timeout extproc may ask for per request (override_message_timeout,
sent while flow control holds a request in its queue); Envoy ignores a longer one, and
every one when this is unset. Keep it above the longest queue time to live plus 2 s.""",
    "forwarding_namespaces:": """\
Endpoint Picker Protocol subset hint (x-gateway-destination-endpoint-subset), if a
filter before this one sets it; forwarded in metadata_context.""",
    "receiving_namespaces:": "Without this the reply's envoy.lb metadata is silently ignored.",
    "name: envoy.filters.http.buffer": """\
Must sit between ext_proc and the router: it holds the request until the whole body
has passed ext_proc, so the router picks the host after the reply's metadata arrived
(with request headers skipped it would otherwise route before the reply).""",
    "name: envoy.access_loggers.http_grpc": """\
How extproc learns that a response ended, where and how: one entry per request on
extproc's own gRPC port (AccessLogService), batched (16 KiB or 10 ms, whichever
first: less CPU per request than a message an entry), with no round per streamed
chunk. Success is response_code
2xx, no response_flags and time_to_last_downstream_tx_byte set (measured: a pod dying
mid-stream keeps its 200 but sets upstream_protocol_error, a client leaving sets
downstream_connection_termination). The served pod is
common_properties.upstream_remote_address, matched to the ext_proc stream by
request.request_id (= the request.id attribute).""",
    "metadata_filter:": """\
Only requests extproc routed (envoy.lb metadata present); ImmediateResponses and
fail-open requests have nothing to record.""",
    "name: extproc": """\
extproc's gRPC server (ext_proc and access log), HTTP/2 as gRPC requires. Envoy
reconnects by itself after an extproc restart.""",
    "name: extproc_pods": """\
The pods: every pod of the pods file as a static endpoint (regenerate when pods
change), or with --pods-dns every address a DNS name resolves to (a Kubernetes
headless Service). override_host can only pick hosts that are members (others in the
list are skipped).""",
    "load_balancing_policy:": """\
override_host walks extproc's list, one host per try. The source is metadata ONLY: a
header source would obey a client-sent x-gateway-destination-endpoint. Health is not
consulted: extproc must list only ready pods.""",
    "fallback_policy:": "When the list is absent (fail-open) or used up by retries.",
    "circuit_breakers:": """\
Envoy's defaults (1024 requests, 3 concurrent retries per cluster) would turn bursts
of long generations into local 503s and skipped fail-overs; the pods queue themselves.""",
}

_BODY_LIMIT = """\
ext_proc BUFFERED, the buffer filter and retries all hold the whole body: this and
the buffer filter's max_request_bytes set the largest request (413 above it)."""

_ROUTE: dict[str, str] = {
    "timeout: 0s": """\
No overall deadline, generations run for minutes; the connection manager's stream
idle timeout (5 min by default) still ends stalled streams.""",
    "retry_policy:": """\
Each retry takes the next pod of extproc's list; a request gets one retry per pod
listed after the first (x-envoy-max-retries, added below), so no retry goes past the
list; num_retries applies without a list (failing open). previous_hosts keeps the
round-robin fallback off pods that already failed. A response whose headers reached
the client is never retried.""",
    "request_headers_to_remove:": """\
Clients must not reach pods with routing headers. ext_proc cannot strip them here:
with request headers skipped, Envoy ignores header mutations in the body reply
(measured), so the route does it.""",
    "request_headers_to_add:": """The prefill pod extproc chose (prefill/decode disaggregation) and the request's
retry count (the fallbacks it listed), from the reply's envoy.lb metadata; each absent
when there is none. Same virtual host as the removal, which runs first, so a client's
copy never survives.""",
}


_TRACING: dict[str, str] = {
    "tracing:": """\
Envoy's OpenTelemetry tracing (envoy-config --otlp-endpoint): a span per request,
random_sampling percent of them, exported over OTLP gRPC. Envoy's gRPC client sends the
ext_proc call's span context (traceparent) in the stream's metadata, so extproc's pick
span (serve --otlp-endpoint) joins the trace; it samples what Envoy samples.""",
    f"name: {OTLP_CLUSTER}": "The OpenTelemetry collector's OTLP gRPC port (HTTP/2).",
}


def render_bootstrap(config: message.Message, *, summary: str) -> str:
    """The standalone bootstrap as commented YAML; ``summary`` goes into the header."""
    header = f"""\
Envoy bootstrap for extproc, generated by `extproc envoy-config` ({summary}).
Regenerate rather than edit; envoy/README.md explains the choices and what was
measured. Listener -> ext_proc (one round: the body) -> buffer -> router -> pods
cluster (override_host)."""
    comments = {
        **_COMMON,
        **_ROUTE,
        "per_connection_buffer_limit_bytes:": _BODY_LIMIT,
        "generate_request_id: true": """\
Envoy makes the x-request-id shared by ext_proc and the access log; as an edge proxy
(use_remote_address) it replaces any id a client sent.""",
        "admin:": "Admin interface, localhost only.",
    }
    data = to_dict(config)
    clusters = data["static_resources"]["clusters"]
    if any(cluster["name"] == OTLP_CLUSTER for cluster in clusters):
        comments.update(_TRACING)
    return to_yaml(data, header=header, comments=comments)


def render_snippet(snippet: Snippet, *, summary: str) -> str:
    """The pieces an existing Envoy needs, as commented YAML keyed by where they go."""
    data = {
        "listener": {
            "per_connection_buffer_limit_bytes": snippet.per_connection_buffer_limit_bytes
        },
        "http_filters": [to_dict(f) for f in snippet.http_filters],
        "access_log": [to_dict(snippet.access_log)],
        "route": to_dict(snippet.route_action),
        "request_headers_to_remove": snippet.request_headers_to_remove,
        "request_headers_to_add": [to_dict(h) for h in snippet.request_headers_to_add],
        "clusters": [to_dict(c) for c in snippet.clusters],
    }
    if snippet.tracing is not None:
        data["tracing"] = to_dict(snippet.tracing)
    header = f"""\
What an existing Envoy needs to route through extproc, generated by
`extproc envoy-config --snippet` ({summary}). Each top-level key says where its
content goes; envoy/envoy.yaml shows them assembled."""
    comments = {
        **_COMMON,
        **_ROUTE,
        "listener:": "Your listener: " + _BODY_LIMIT,
        "http_filters:": """\
Your HttpConnectionManager's http_filters: these two, in this order, right before
envoy.filters.http.router. Envoy's default generate_request_id: true must stay on.""",
        "access_log:": "Append to your HttpConnectionManager's access_log.",
        "route:": """\
The RouteAction ("route:") of your LLM route(s): the pods cluster, no deadline, and
the retry policy that walks extproc's list.""",
        "request_headers_to_remove:": "On your LLM routes' virtual host. "
        + _ROUTE["request_headers_to_remove:"],
        "request_headers_to_add:": "On the same virtual host. " + _ROUTE["request_headers_to_add:"],
        "clusters:": "Add to static_resources.clusters (or serve them by CDS).",
    }
    if snippet.tracing is not None:
        comments.update(_TRACING)
        comments["tracing:"] = "Your HttpConnectionManager's tracing. " + _TRACING["tracing:"]
    return to_yaml(data, header=header, comments=comments)
