"""The servers on extproc's ports: ext_proc + access log on one gRPC port, health on
another (as the Gateway API Inference Extension's picker does).

The gRPC port is served by the one-thread loop (``grpc_loop``) when the installed grpcio
passes its self-check, else by grpcio's public server (``grpc_public``); ``--grpc-server``
forces either.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from concurrent import futures
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.errors import ConfigError
from extproc.routing.router import Router
from extproc.wire.access_log import AccessLogHandler, access_log_method
from extproc.wire.grpc_loop import LoopServer, Method, self_check
from extproc.wire.grpc_public import PublicServer
from extproc.wire.one_round import RouteHandler, one_round_process
from extproc.wire.protocol import ACCESS_LOG_PATH, EXT_PROC_SERVICE, PROCESS_PATH

log = logging.getLogger("extproc.grpc")

GRPC_MESSAGE_HEADROOM_BYTES = 1 << 20  # a body at the limit still fits in its message
GRPC_SERVERS = ("auto", "loop", "public")


class Stopped(Protocol):
    def wait(self, timeout: float | None = None) -> bool: ...


class GrpcServer(Protocol):
    """What ``LoopServer`` and ``PublicServer`` both offer."""

    def add_insecure_port(self, address: str) -> int: ...

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int: ...

    @property
    def open_streams(self) -> int: ...

    def start(self) -> None: ...

    def drain(self, keep: Collection[str]) -> None: ...

    def stop(self, grace: float | None) -> Stopped: ...


def choose_server(kind: str) -> tuple[type[LoopServer | PublicServer], str]:
    """The server class for ``--grpc-server`` and why, in words for the start-up log.

    Raises:
        ConfigError: an unknown kind, or ``loop`` on a grpcio that fails the self-check.
    """
    if kind not in GRPC_SERVERS:
        raise ConfigError(f"--grpc-server must be one of {', '.join(GRPC_SERVERS)}, got {kind!r}")
    if kind == "public":
        return PublicServer, "grpcio's public server, as --grpc-server public asks"
    problem = self_check()
    if problem is None:
        return (
            LoopServer,
            f"the one-thread loop server (grpcio {grpc.__version__} passed its check)",
        )
    if kind == "loop":
        raise ConfigError(f"--grpc-server loop cannot run: {problem}")
    return PublicServer, f"grpcio's public server, because {problem}"


def make_grpc_server(
    router: Router,
    address: str,
    *,
    process: Method | None = None,
    max_streams: int = 4096,
    max_message_bytes: int = 32 * 1024 * 1024,
    server_kind: str = "auto",
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[GrpcServer, int]:
    """The ext_proc + access-log server, bound to ``address``; returns it and its port.

    ``process`` replaces the one-round ``Process`` (``wire.epp.epp_process``). Streams
    past ``max_streams`` are refused at once (RESOURCE_EXHAUSTED: Envoy answers 500 or
    fails open). ``server_kind``: ``--grpc-server`` (``choose_server``); ``credentials``:
    TLS on the port (None: plaintext).

    Raises:
        ConfigError: see ``choose_server``.
        OSError: the address cannot be bound.
    """
    server_class, why = choose_server(server_kind)
    fell_back = server_kind == "auto" and server_class is PublicServer
    log.log(logging.WARNING if fell_back else logging.INFO, "gRPC port served by %s", why)
    server: GrpcServer = server_class(
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
    return server, bind(server, address, "gRPC", credentials)


def bind(
    server: grpc.Server | GrpcServer,
    address: str,
    what: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """``add_insecure_port`` (``add_secure_port`` with ``credentials``), failing with an
    ``OSError`` naming the address.

    grpcio reports a failed bind by returning 0 or, in newer versions, a RuntimeError.
    """
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
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
