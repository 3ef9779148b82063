"""The servers on extproc's ports: ext_proc + access log on one gRPC port, health on
another (as the Gateway API Inference Extension's picker does)."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.routing.router import Router
from extproc.wire.access_log import AccessLogHandler, access_log_method
from extproc.wire.grpc_loop import LoopServer, Method
from extproc.wire.one_round import RouteHandler, one_round_process
from extproc.wire.protocol import ACCESS_LOG_PATH, EXT_PROC_SERVICE, PROCESS_PATH

GRPC_MESSAGE_HEADROOM_BYTES = 1 << 20  # a body at the limit still fits in its message


def make_grpc_server(
    router: Router,
    address: str,
    *,
    process: Method | None = None,
    max_streams: int = 4096,
    max_message_bytes: int = 32 * 1024 * 1024,
) -> tuple[LoopServer, int]:
    """The ext_proc + access-log server, bound to ``address``; returns it and its port.

    ``process`` replaces the one-round ``Process`` (``wire.epp.epp_process``). Streams
    past ``max_streams`` are refused at once (RESOURCE_EXHAUSTED: Envoy answers 500 or
    fails open).
    """
    server = LoopServer(
        {
            PROCESS_PATH: process or one_round_process(RouteHandler(router)),
            ACCESS_LOG_PATH: access_log_method(AccessLogHandler(router)),
        },
        max_streams=max_streams,
        options=[
            ("grpc.so_reuseport", 0),  # a stale server must not silently share the port
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )
    return server, bind(server, address, "gRPC")


def bind(server: grpc.Server | LoopServer, address: str, what: str) -> int:
    """``add_insecure_port``, failing with an ``OSError`` naming the address.

    grpcio reports a failed bind by returning 0 or, in newer versions, a RuntimeError.
    """
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if not port:
        raise OSError(f"cannot bind the {what} server to {address} (in use or not local)")
    return int(port)


def make_health_server(address: str) -> tuple[grpc.Server, health.HealthServicer, int]:
    """The standard gRPC health service on its own port (as the GIE picker does)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="extproc-health"),
        options=[("grpc.so_reuseport", 0)],
    )
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = bind(server, address, "health")
    set_serving(servicer, False)
    return server, servicer, port


def set_serving(servicer: health.HealthServicer, serving: bool) -> None:
    """Health of the whole server and of the ext_proc service."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for service in ("", EXT_PROC_SERVICE):
        servicer.set(service, status)
