"""The gRPC layer: Envoy's ext_proc and access-log protos in, ``Router`` calls out.

One ext_proc message round per request (``envoy/README.md``): Envoy skips the request
headers and sends the buffered body with the attributes extproc needs (path, request id,
session header). ``Process`` is registered stream-unary: it reads that one message and
returns one reply, with the ordered pod list in dynamic metadata
``envoy.lb/x-gateway-destination-endpoint``, or an ``ImmediateResponse`` carrying the
OpenAI-style JSON error. ``StreamAccessLogs`` receives one entry per routed request as it
ends, which tells whether the response ended successfully and which pod served it.

Nothing here knows a plugin; every error is answered, never raised into grpcio.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.epp import (
    ATTRIBUTES_KEY,
    DESTINATION_KEY,
    DESTINATION_NAMESPACE,
    PATH_ATTRIBUTE,
    PREFILL_HEADER,
    REQUEST_ID_ATTRIBUTE,
    SUBSET_HINT_KEY,
    SUBSET_HINT_NAMESPACE,
    header_attribute,
)
from extproc.errors import BadRequest, ExtProcError
from extproc.routing import Router

log = logging.getLogger("extproc.server")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
ACCESS_LOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"

_JSON_CONTENT_TYPE = base_pb2.HeaderValueOption(
    header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")
)


def error_response(error: ExtProcError) -> ep.ProcessingResponse:
    """An ImmediateResponse: the error's status and its OpenAI-style JSON body."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.http_status),
            headers=ep.HeaderMutation(set_headers=[_JSON_CONTENT_TYPE]),
            body=error.to_body(),
            details=f"extproc_{error.code}",
        )
    )


def route_metadata(destination: str, prefill: str | None = None) -> struct_pb2.Struct:
    """``envoy.lb``: the destination list, best first (and the prefill pod, if any)."""
    metadata = struct_pb2.Struct()
    fields = metadata.fields[DESTINATION_NAMESPACE].struct_value.fields
    fields[DESTINATION_KEY].string_value = destination
    if prefill:
        fields[PREFILL_HEADER].string_value = prefill
    return metadata


def route_response(destination: str, prefill: str | None = None) -> ep.ProcessingResponse:
    """The body reply: continue, with the destination list (and prefill pod) as metadata."""
    metadata = route_metadata(destination, prefill)
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=ep.CommonResponse()),
        dynamic_metadata=metadata,
    )


class ExtProcHandlers:
    """The two RPC handlers, over one ``Router``."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._session_attribute = (
            header_attribute(router.session_header) if router.session_header else None
        )

    # -- ext_proc --------------------------------------------------------------------

    def process(
        self, requests: Iterator[ep.ProcessingRequest], context: Any
    ) -> ep.ProcessingResponse:
        """Stream-unary ``Process``: one message in (the buffered body), one reply out."""
        request_id = ""
        try:
            try:
                message = next(requests, None)
            except grpc.RpcError:  # cancelled, or bytes that are not a message: gRPC answered
                log.debug("ext_proc stream ended before its message arrived")
                return ep.ProcessingResponse()
            if message is None:
                return ep.ProcessingResponse()
            attributes = message.attributes[ATTRIBUTES_KEY].fields
            request_id = attributes[REQUEST_ID_ATTRIBUTE].string_value
            kind = message.WhichOneof("request")
            if kind != "request_body":
                # Only reachable with another processing mode than envoy/ ships: let the
                # request through unrouted (Envoy's fallback policy picks) and say why.
                log.warning(
                    "request %s: got %s, expected request_body; check the ext_proc "
                    "processing mode (request headers SKIP, body BUFFERED)",
                    request_id,
                    kind,
                )
                return _continue(kind)
            body = message.request_body
            if not body.end_of_stream:
                raise BadRequest(
                    "extproc needs the whole request body (ext_proc body mode BUFFERED)",
                    code="body_not_buffered",
                )
            headers = {}
            if self._session_attribute and self._session_attribute in attributes:
                headers[self.router.session_header or ""] = attributes[
                    self._session_attribute
                ].string_value
            decision = self.router.route(
                attributes[PATH_ATTRIBUTE].string_value,
                body.body,
                request_id=request_id or None,
                headers=headers,
                subset=subset_hint(message),
            )
            if context is not None and not context.is_active():
                # Envoy stopped waiting (message timeout: a 504 or a fail-open route; or
                # the client left): no access-log entry will come for this route.
                self.router.abandon(request_id)
                return ep.ProcessingResponse()
            prefill = decision.prefill.address if decision.prefill else None
            return route_response(decision.destination, prefill)
        except ExtProcError as exc:
            log.debug("request %s: %s %s", request_id, exc.http_status, exc.message)
            return error_response(exc)
        except Exception:
            log.exception("request %s: unexpected error while routing", request_id)
            return error_response(
                ExtProcError(f"internal error in the endpoint picker (request id {request_id})")
            )

    # -- access log ------------------------------------------------------------------

    def stream_access_logs(
        self, messages: Iterator[als_pb2.StreamAccessLogsMessage], context: Any
    ) -> als_pb2.StreamAccessLogsResponse:
        """Client-streaming ``StreamAccessLogs``: one entry per routed request as it ends."""
        try:
            for message in messages:
                for entry in message.http_logs.log_entry:
                    try:
                        self._complete(entry)
                    except Exception:
                        log.exception("access log entry %s", entry.request.request_id)
        except grpc.RpcError:
            pass  # Envoy went away; it reopens the stream when it comes back
        return als_pb2.StreamAccessLogsResponse()

    def _complete(self, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        common = entry.common_properties
        code = entry.response.response_code.value
        flags = [f.name for f, v in common.response_flags.ListFields() if v]
        succeeded = (
            200 <= code < 300 and not flags and common.HasField("time_to_last_downstream_tx_byte")
        )
        sock = common.upstream_remote_address.socket_address
        served = f"{sock.address}:{sock.port_value}" if sock.address else None
        attempts = common.upstream_request_attempt_count or 1
        recorded = self.router.complete(entry.request.request_id, served, succeeded, attempts)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s ended: %d %s via %s, recorded=%s",
                entry.request.request_id,
                code,
                flags or "ok",
                served,
                recorded,
            )


def _continue(kind: str | None) -> ep.ProcessingResponse:
    common = ep.CommonResponse()
    if kind == "request_headers":
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common))
    if kind == "response_headers":
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=common))
    if kind == "response_body":
        return ep.ProcessingResponse(response_body=ep.BodyResponse(response=common))
    if kind == "request_trailers":
        return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
    if kind == "response_trailers":
        return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
    return ep.ProcessingResponse()


def subset_hint(message: ep.ProcessingRequest) -> list[str] | None:
    """The gateway's subset hint: a list of ``ip:port`` (or one comma-separated string)."""
    namespaces = message.metadata_context.filter_metadata
    if SUBSET_HINT_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_HINT_NAMESPACE].fields
    if SUBSET_HINT_KEY not in fields:
        return None
    value = fields[SUBSET_HINT_KEY]
    if value.WhichOneof("kind") == "list_value":
        return [v.string_value for v in value.list_value.values if v.string_value]
    return [a.strip() for a in value.string_value.split(",") if a.strip()]


def one_round_process(handlers: ExtProcHandlers) -> grpc.RpcMethodHandler:
    """``Process`` for extproc's own Envoy config: stream-unary, one message each way."""
    return grpc.stream_unary_rpc_method_handler(
        handlers.process,
        request_deserializer=ep.ProcessingRequest.FromString,
        response_serializer=ep.ProcessingResponse.SerializeToString,
    )


class LogStreamBudget:
    """At most ``limit`` access-log streams at once; past it a new one is refused.

    The sync server holds a worker thread per open stream, and Envoy keeps one
    access-log stream open per worker thread for good: enough Envoys would otherwise
    take every thread and leave none to route with.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)
        self._warned_s = -float("inf")

    def serve(
        self,
        handler: Callable[[Iterator[als_pb2.StreamAccessLogsMessage], Any], Any],
    ) -> Callable[[Iterator[als_pb2.StreamAccessLogsMessage], Any], Any]:
        def limited(messages: Iterator[als_pb2.StreamAccessLogsMessage], context: Any) -> Any:
            if not self._slots.acquire(blocking=False):
                self._warn()
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"extproc takes at most {self.limit} access-log streams (--grpc-workers / 4)",
                )
            try:
                return handler(messages, context)
            finally:
                self._slots.release()

        return limited

    def _warn(self) -> None:
        now = time.monotonic()
        if now - self._warned_s > 60:
            self._warned_s = now
            log.warning(
                "refusing an access-log stream: %d are open already (one per Envoy worker); "
                "their requests are not recorded. Raise --grpc-workers (4 per stream)",
                self.limit,
            )


def make_grpc_server(
    handlers: ExtProcHandlers,
    address: str,
    *,
    process: grpc.RpcMethodHandler | None = None,
    max_workers: int = 32,
    max_message_bytes: int = 32 * 1024 * 1024,
) -> tuple[grpc.Server, int]:
    """The ext_proc + access-log server, bound to ``address``; returns it and its port.

    ``process`` replaces the one-round ``Process`` handler (``gateway.epp_process``).
    Each open stream holds one of ``max_workers`` threads: an EPP stream for its request's
    whole life, an access-log stream for good. Streams past ``max_workers`` are refused
    at once (RESOURCE_EXHAUSTED: Envoy answers 500 or fails open) rather than queued
    until Envoy's message timeout; access logs may take a quarter of the workers.
    """
    log_streams = LogStreamBudget(max(1, max_workers // 4))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="extproc-grpc"),
        maximum_concurrent_rpcs=max_workers,
        options=[
            ("grpc.so_reuseport", 0),  # a stale server must not silently share the port
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                EXT_PROC_SERVICE,
                {"Process": process or one_round_process(handlers)},
            ),
            grpc.method_handlers_generic_handler(
                ACCESS_LOG_SERVICE,
                {
                    "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                        log_streams.serve(handlers.stream_access_logs),
                        request_deserializer=als_pb2.StreamAccessLogsMessage.FromString,
                        response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString,
                    )
                },
            ),
        )
    )
    return server, _bind(server, address, "gRPC")


def _bind(server: grpc.Server, address: str, what: str) -> int:
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
    port = _bind(server, address, "health")
    for service in ("", EXT_PROC_SERVICE):
        servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, servicer, port
