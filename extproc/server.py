"""The gRPC layer: Envoy's ext_proc and access-log protos in, ``Router`` calls out.

One ext_proc message round per request (``envoy/README.md``): Envoy skips the request
headers and sends the buffered body with the attributes extproc needs (path, request id,
session header). ``Process`` reads that one message and answers with one reply and the
OK status together: the ordered pod list in dynamic metadata
``envoy.lb/x-gateway-destination-endpoint``, or an ``ImmediateResponse`` carrying the
OpenAI-style JSON error. ``StreamAccessLogs`` receives one entry per routed request as it
ends, which tells whether the response ended successfully and which pod served it.
Both run on ``grpc_loop.LoopServer`` (one thread, no hand-offs: why is there).

Nothing here knows a plugin; every error is answered, never raised into the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future

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
from extproc.grpc_loop import Answer, LoopServer, Method, Stream, run_off_loop
from extproc.memo import FifoMemo
from extproc.routing import Router

log = logging.getLogger("extproc.server")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
ACCESS_LOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
ACCESS_LOG_PATH = f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs"

# Bodies this big take tens of milliseconds and more to parse and render (a quarter of a
# million chat messages: about 0.7 s); they are routed off the loop so that the requests
# behind them are not held up.
OFF_LOOP_BODY_BYTES = 1 << 20

_JSON_CONTENT_TYPE = base_pb2.HeaderValueOption(
    header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")
)


def internal_error_response(request_id: str) -> ep.ProcessingResponse:
    """A 500 for a bug while routing: names the request, never the trace."""
    return error_response(
        ExtProcError(f"internal error in the endpoint picker (request id {request_id})")
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
    """The two services' logic over one ``Router``: route a body, complete a log entry."""

    def __init__(self, router: Router) -> None:
        self.router = router
        # Route replies serialized once per destination list (and prefill pod): the
        # lists repeat (the model's pods, best first), and building one costs 7 us.
        self._replies: FifoMemo[tuple[str, str | None], bytes] = FifoMemo(4096)
        self._session_attribute = (
            header_attribute(router.session_header) if router.session_header else None
        )

    # -- ext_proc --------------------------------------------------------------------

    def process(
        self, message: ep.ProcessingRequest
    ) -> tuple[ep.ProcessingResponse | bytes, str | None]:
        """The one-round ``Process`` message -> the reply (a route comes serialized), and
        the request id routed (to forget if the reply never reaches Envoy). Every error
        becomes the reply."""
        request_id = ""
        try:
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
                return _continue(kind), None
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
            prefill = decision.prefill.address if decision.prefill else None
            reply = self._replies.get(
                (decision.destination, prefill),
                lambda: route_response(decision.destination, prefill).SerializeToString(),
            )
            return reply, request_id or None
        except ExtProcError as exc:
            log.debug("request %s: %s %s", request_id, exc.http_status, exc.message)
            return error_response(exc), None
        except Exception:
            log.exception("request %s: unexpected error while routing", request_id)
            return internal_error_response(request_id), None

    # -- access log ------------------------------------------------------------------

    def complete(self, message: als_pb2.StreamAccessLogsMessage) -> None:
        """One access-log message: each entry tells how a routed request ended."""
        for entry in message.http_logs.log_entry:
            try:
                self._complete(entry)
            except Exception:
                log.exception("access log entry %s", entry.request.request_id)

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


class _OneRoundStream:
    """``Process`` as extproc's own Envoy config drives it: one message, one reply."""

    __slots__ = ("_handlers", "_routed")

    def __init__(self, handlers: ExtProcHandlers) -> None:
        self._handlers = handlers
        self._routed: str | None = None

    def on_message(self, message: ep.ProcessingRequest) -> Answer | Future[Answer]:
        if len(message.request_body.body) >= OFF_LOOP_BODY_BYTES:
            return run_off_loop(lambda: self._route(message))
        return self._route(message)

    def _route(self, message: ep.ProcessingRequest) -> Answer:
        reply, self._routed = self._handlers.process(message)
        return Answer((reply,), end=True)

    def on_input_end(self) -> Answer:
        return Answer((ep.ProcessingResponse(),), end=True)

    def on_close(self, delivered: bool) -> None:
        if not delivered and self._routed is not None:
            # Envoy stopped waiting (message timeout: a 504 or a fail-open route; or the
            # client left): no access-log entry will come for this route.
            self._handlers.router.abandon(self._routed)


class _AccessLogStream:
    """``StreamAccessLogs``: Envoy keeps one open per worker, an entry per request."""

    __slots__ = ("_handlers",)

    def __init__(self, handlers: ExtProcHandlers) -> None:
        self._handlers = handlers

    def on_message(self, message: als_pb2.StreamAccessLogsMessage) -> Answer:
        self._handlers.complete(message)
        return Answer()

    def on_input_end(self) -> Answer:
        return Answer((als_pb2.StreamAccessLogsResponse(),), end=True)

    def on_close(self, delivered: bool) -> None:
        pass


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


def process_method(open_stream: Callable[[], Stream]) -> Method:
    """ext_proc's ``Process``, its streams opened by ``open_stream``."""
    return Method(
        parse=ep.ProcessingRequest.FromString,
        serialize=ep.ProcessingResponse.SerializeToString,
        open=open_stream,
        name="ProcessingRequest",
    )


def one_round_process(handlers: ExtProcHandlers) -> Method:
    """``Process`` for extproc's own Envoy config: one message each way."""
    return process_method(lambda: _OneRoundStream(handlers))


def make_grpc_server(
    handlers: ExtProcHandlers,
    address: str,
    *,
    process: Method | None = None,
    max_streams: int = 4096,
    max_message_bytes: int = 32 * 1024 * 1024,
) -> tuple[LoopServer, int]:
    """The ext_proc + access-log server, bound to ``address``; returns it and its port.

    ``process`` replaces the one-round ``Process`` (``gateway.epp_process``). Streams
    past ``max_streams`` are refused at once (RESOURCE_EXHAUSTED: Envoy answers 500 or
    fails open).
    """
    access_log = Method(
        parse=als_pb2.StreamAccessLogsMessage.FromString,
        serialize=als_pb2.StreamAccessLogsResponse.SerializeToString,
        open=lambda: _AccessLogStream(handlers),
        name="StreamAccessLogsMessage",
    )
    server = LoopServer(
        {
            f"/{EXT_PROC_SERVICE}/Process": process or one_round_process(handlers),
            ACCESS_LOG_PATH: access_log,
        },
        max_streams=max_streams,
        options=[
            ("grpc.so_reuseport", 0),  # a stale server must not silently share the port
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )
    return server, _bind(server, address, "gRPC")


def _bind(server: grpc.Server | LoopServer, address: str, what: str) -> int:
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
