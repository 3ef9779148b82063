"""ext_proc messages shared by the one-round and EPP handlers: the ``Process`` method,
what they read from a request (the gateway's subset hint) and the replies they build
(a route in ``envoy.lb`` metadata, an OpenAI-style error, a plain continue)."""

from __future__ import annotations

import math
from collections.abc import Callable

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from extproc.errors import ExtProcError
from extproc.routing.flow.held import Held
from extproc.wire.grpc_loop import Metadata, Method, Stream
from extproc.wire.protocol import (
    DESTINATION_KEY,
    DESTINATION_NAMESPACE,
    MAX_RETRIES_HEADER,
    PREFILL_HEADER,
    SUBSET_HINT_KEY,
    SUBSET_HINT_NAMESPACE,
)

# Bodies this big are slow to parse and render; they are routed off the loop so that the
# requests behind them are not held up.
OFF_LOOP_BODY_BYTES = 1 << 20

# A held request's message timeout runs this long past its time to live: the refusal
# (or the route) is decided at the deadline and must reach Envoy before its timer fires.
HOLD_MARGIN_S = 2.0

# W3C trace context: Envoy's async gRPC client puts the ext_proc call's span in the
# stream's metadata (a child of Envoy's request span), not in the request's headers.
TRACE_CONTEXT_KEYS = frozenset({"traceparent", "tracestate"})

_JSON_CONTENT_TYPE = base_pb2.HeaderValueOption(
    header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")
)


def process_method(
    open_stream: Callable[[], Stream],
    open_with_metadata: Callable[[Metadata], Stream] | None = None,
) -> Method:
    """ext_proc's ``Process``, its streams opened by ``open_stream``, or given the call's
    metadata (Envoy's trace context) by ``open_with_metadata``."""
    return Method(
        parse=ep.ProcessingRequest.FromString,
        serialize=ep.ProcessingResponse.SerializeToString,
        open=open_stream,
        name="ProcessingRequest",
        open_with_metadata=open_with_metadata,
    )


def trace_context(metadata: Metadata) -> Metadata:
    """The W3C trace context among a call's metadata (empty values left out), passed to
    the router among the request's headers (over a client's own)."""
    return tuple((key, value) for key, value in metadata if key in TRACE_CONTEXT_KEYS and value)


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


def internal_error_response(request_id: str) -> ep.ProcessingResponse:
    """A 500 for a bug while routing: names the request, never the trace."""
    return error_response(
        ExtProcError(f"internal error in the endpoint picker (request id {request_id})")
    )


def error_response(error: ExtProcError) -> ep.ProcessingResponse:
    """An ImmediateResponse: the error's status and its OpenAI-style JSON body (and
    ``retry-after`` when the error says when to retry)."""
    headers = [_JSON_CONTENT_TYPE]
    if error.retry_after_s is not None:
        headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(
                    key="retry-after", raw_value=str(error.retry_after_s).encode()
                )
            )
        )
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.http_status),
            headers=ep.HeaderMutation(set_headers=headers),
            body=error.to_body(),
            details=f"extproc_{error.code}",
        )
    )


def hold_response(held: Held) -> ep.ProcessingResponse:
    """The reply that keeps Envoy waiting for a held request: its message timer restarted
    for the hold's time left plus a margin (the route or refusal comes by then). Envoy
    ignores it above the filter's ``max_message_timeout``."""
    seconds = math.ceil(held.hold_s() + HOLD_MARGIN_S)
    return ep.ProcessingResponse(override_message_timeout=duration_pb2.Duration(seconds=seconds))


def route_metadata(destination: str, prefill: str | None = None) -> struct_pb2.Struct:
    """``envoy.lb``: the destination list, best first, its retry count (and the prefill
    pod, if any)."""
    metadata = struct_pb2.Struct()
    _fill_route_metadata(metadata, destination, prefill)
    return metadata


def route_response(destination: str, prefill: str | None = None) -> ep.ProcessingResponse:
    """The body reply: continue, with the destination list (and prefill pod) as metadata.

    Built in place: passing a built Struct to the constructor copies it, which costs
    more than building it."""
    reply = ep.ProcessingResponse()
    reply.request_body.response.SetInParent()
    _fill_route_metadata(reply.dynamic_metadata, destination, prefill)
    return reply


def set_body(common: ep.CommonResponse, body: bytes) -> None:
    """Send ``body`` (a model rewrite's) instead of the client's, with its length: Envoy
    (since 1.29) leaves a buffered body's content-length to the processor, and an upstream
    told the old length would cut or wait for the body."""
    common.body_mutation.body = body
    set_content_length(common, len(body))


def set_content_length(common: ep.CommonResponse, length: int) -> None:
    """The request's content-length set to ``length`` (a body of another length sent)."""
    common.header_mutation.set_headers.append(
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-length", raw_value=str(length).encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
    )


def _fill_route_metadata(
    metadata: struct_pb2.Struct, destination: str, prefill: str | None
) -> None:
    fields = metadata.fields[DESTINATION_NAMESPACE].struct_value.fields
    fields[DESTINATION_KEY].string_value = destination
    fields[MAX_RETRIES_HEADER].string_value = str(destination.count(","))
    if prefill:
        fields[PREFILL_HEADER].string_value = prefill


def continue_response(kind: str | None) -> ep.ProcessingResponse:
    """Let a message of ``kind`` through unchanged."""
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
