"""Instant upstream "pods" for the proxy benchmarks: one Envoy, one listener per pod.

Every pod is its own ``127.0.0.1:port`` (routers tell pods apart by address), served by
one Envoy process with a listener per port, each answering from ``direct_response``:

    POST /v1/...            200, a small completion JSON, header ``x-sim-pod``
    GET  /metrics           an idle vLLM pod's gauges (extproc's scraper reads them)
    GET  /health            200 (sglang-router's health check)
    GET  /v1/models         one model card (sglang-router's readiness, through the router)
    GET  /get_server_info,  ``{}``: sglang-router probes them at start; no ``model_path``,
         /get_model_info    or it tries to download a tokenizer (../shared/TOOLING.md)

So the measured cost is the proxy's and the picker's, never a model's. One Envoy with
1,000 listeners is ready in about 6 s on 2 cores.
"""

from __future__ import annotations

import socket
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson

from extproc.pods import Pod, PodId
from extproc.sim.launch import Proc, start_envoy_config

MODEL = "bench"
# What an idle vLLM pod's /metrics says, so the picker's scraper reads real series.
METRICS_PAGE = (
    f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0\n'
    f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0\n'
    f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.1\n'
)
COMPLETION = orjson.dumps(
    {"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [{"text": "ok"}]}
).decode()
MODELS = orjson.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm"}]}
).decode()
# GET probes answered before the catch-all completion route: (path prefix, body).
PROBES = (
    ("/metrics", METRICS_PAGE),
    ("/health", ""),
    ("/v1/models", MODELS),
    ("/get_server_info", "{}"),
    ("/get_model_info", "{}"),
)
BUFFER_LIMIT_BYTES = 16 << 20  # bodies up to 16 MiB, like extproc's default max body


def free_ports(num_ports: int) -> list[int]:
    """``num_ports`` distinct free ports of 127.0.0.1 (all bound at once, then released)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(num_ports)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def _direct(prefix: str, body: str) -> dict[str, Any]:
    return {"match": {"prefix": prefix},
            "direct_response": {"status": 200, "body": {"inline_string": body}}}  # fmt: skip


def _listener(port: int) -> dict[str, Any]:
    completion = _direct("/", COMPLETION)
    completion["response_headers_to_add"] = [
        {"header": {"key": "x-sim-pod", "value": f"pod-{port}"}}
    ]
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": f"pod{port}",
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            *(_direct(path, body) for path, body in PROBES), completion]}]},
    }  # fmt: skip
    return {
        "name": f"pod{port}",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
    }  # fmt: skip


def upstream_config(ports: list[int], admin_port: int) -> dict[str, Any]:
    """One Envoy bootstrap: a listener per pod port, every answer from ``direct_response``."""
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {"listeners": [_listener(p) for p in ports]},
    }


def start_upstreams(num_pods: int, log_dir: Path) -> tuple[Proc, list[Pod]]:
    """Start the pods' Envoy (stop it with ``Proc.stop``) and return it with the pods."""
    *ports, admin_port = free_ports(num_pods + 1)
    proc = start_envoy_config(upstream_config(ports, admin_port), admin_port, log_dir, "upstreams")
    pods = [Pod(PodId("default", f"pod-{p}"), f"127.0.0.1:{p}", frozenset({MODEL})) for p in ports]
    return proc, pods
