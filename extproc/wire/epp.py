"""ext_proc for gateways that speak the Endpoint Picker Protocol (``--protocol epp``).

Gateway API implementations (Envoy Gateway, Istio, GKE, the Inference Extension's
reference setup) configure the ext_proc filter themselves: request headers are sent
first, the body follows either BUFFERED or FULL_DUPLEX_STREAMED, and the picked endpoint
is read from the ``x-gateway-destination-endpoint`` request header and/or the
``envoy.lb`` dynamic metadata. This handler serves that whole exchange on one
bidirectional stream:

* request headers: remembered (path, ``x-request-id``, the session header); client-sent
  routing headers are removed. With a BUFFERED body the headers are answered at once;
  with FULL_DUPLEX_STREAMED the answer waits for the body (Envoy's rule for that mode).
* request body: at its end the request is routed; the pick goes out as the destination
  header and as metadata (the pod list, best first). FULL_DUPLEX_STREAMED then sends the
  whole body back as the streamed body. A model rewrite's body goes instead (BUFFERED: as
  the body reply's ``body_mutation``), with its ``content-length``.
* response: if the gateway sends the response headers and body, the request is
  recorded when the body ends with a 2xx status, for the endpoint the gateway reports as
  served (``x-gateway-destination-endpoint-served`` in ``envoy.lb`` metadata) or else the
  pick. A stream that ends otherwise records nothing.

A request flow control holds (a ``Held``) gets, at the body's end, a reply extending
Envoy's message timeout past the hold (``override_message_timeout``), then the pick or
the refusal; a stream cancelled meanwhile cancels the hold (envoy/README.md says how
Envoy times each body mode).

The one-round handler in ``one_round.py`` stays the default for extproc's own Envoy config;
this one costs a message round per phase.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.errors import BadRequest, BodyTooLarge, ExtProcError
from extproc.routing.decision import RouteDecision
from extproc.routing.flow.held import Held
from extproc.routing.router import Router
from extproc.wire.ext_proc import (
    OFF_LOOP_BODY_BYTES,
    error_response,
    hold_response,
    internal_error_response,
    process_method,
    route_metadata,
    set_body,
    set_content_length,
    subset_hint,
    trace_context,
)
from extproc.wire.grpc_loop import Answer, Metadata, Method, run_off_loop, then
from extproc.wire.protocol import DESTINATION_KEY, DESTINATION_NAMESPACE, INTERNAL_HEADERS

log = logging.getLogger("extproc.wire")

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
SERVED_KEY = f"{DESTINATION_KEY}-served"


@dataclass
class _Exchange:
    """One request's state across the stream's messages."""

    request_id: str = ""
    key: str = ""  # the router's pending key: this stream's own, whatever the request id
    path: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    full_duplex: bool = False
    body: bytearray = field(default_factory=bytearray)
    decision: RouteDecision | None = None
    held: Held | None = None  # while flow control holds the request
    subset: list[str] | None = None
    status: int = 0
    served: str | None = None
    done: bool = False
    trace: Metadata = ()  # the stream's trace context (``trace_context``)


def _header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else str(h.value)


def _set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


class GatewayHandler:
    """Stream-stream ``Process`` for the Endpoint Picker Protocol."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._streams = itertools.count()

    def open(self, metadata: Metadata = ()) -> _EppStream:
        return _EppStream(self, trace_context(metadata))

    def handle(
        self, exchange: _Exchange, message: ep.ProcessingRequest
    ) -> Iterator[ep.ProcessingResponse]:
        """The replies to any message but a body (``on_request_body``)."""
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            yield from self._on_request_headers(exchange, message)
        elif kind == "request_trailers":
            yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
        elif kind == "response_headers":
            hdrs = message.response_headers
            status = next(
                (_header_value(h) for h in hdrs.headers.headers if h.key == ":status"), ""
            )
            exchange.status = int(status) if status.isdigit() else 0
            exchange.served = _served(message) or exchange.served
            if hdrs.end_of_stream:
                self._complete(exchange, ok=True)
            yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        elif kind == "response_body":
            if message.response_body.end_of_stream:
                self._complete(exchange, ok=True)
            yield ep.ProcessingResponse(response_body=ep.BodyResponse())
        elif kind == "response_trailers":
            self._complete(exchange, ok=True)
            yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())

    def _on_request_headers(
        self, exchange: _Exchange, message: ep.ProcessingRequest
    ) -> Iterator[ep.ProcessingResponse]:
        for h in message.request_headers.headers.headers:
            exchange.headers[h.key.lower()] = _header_value(h)
        exchange.headers.update(exchange.trace)
        exchange.path = exchange.headers.get(":path", "")
        exchange.request_id = exchange.headers.get("x-request-id") or f"epp-{uuid.uuid4()}"
        exchange.full_duplex = message.protocol_config.request_body_mode == FULL_DUPLEX
        exchange.subset = subset_hint(message)
        if message.request_headers.end_of_stream:
            raise BadRequest(
                "the request has no body: extproc routes OpenAI-style JSON requests",
                code="invalid_json",
            )
        if not exchange.full_duplex:  # BUFFERED: Envoy waits for this answer before the body
            yield ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=self._strip_internal())
            )

    def on_request_body(
        self, exchange: _Exchange, message: ep.ProcessingRequest
    ) -> list[ep.ProcessingResponse] | Future[list[ep.ProcessingResponse]]:
        """The replies to a body message; at the body's end the request is routed
        (``Router.route_or_defer``: a Future when it is prepared on the router's threads
        or held by flow control, then ``exchange.held`` is the hold)."""
        body = message.request_body
        if exchange.decision is not None:  # routed already: a second body is not routed again
            return [ep.ProcessingResponse(request_body=ep.BodyResponse())]
        exchange.body += body.body
        if len(exchange.body) > self.router.max_body_bytes:  # Envoy sets no limit in full duplex
            raise BodyTooLarge(
                f"request body is over the limit of {self.router.max_body_bytes} bytes"
            )
        if not body.end_of_stream:
            if not exchange.full_duplex:
                raise BadRequest(
                    "extproc needs the whole request body (ext_proc body mode BUFFERED or "
                    "FULL_DUPLEX_STREAMED)",
                    code="body_not_buffered",
                )
            return []
        # Keyed by stream: the completion comes on this stream, and a request id repeated
        # by a client (gateways may keep it) must not cross two streams' records.
        exchange.key = f"{exchange.request_id}/{next(self._streams)}"
        decided = self.router.route_or_defer(
            exchange.path,
            bytes(exchange.body),
            request_id=exchange.key,
            headers=exchange.headers,
            subset=exchange.subset,
        )
        if isinstance(decided, Future):
            if isinstance(decided, Held):
                exchange.held = decided
            return then(decided, lambda result: list(self._routed(exchange, result())))
        return list(self._routed(exchange, decided))

    def _routed(
        self, exchange: _Exchange, decision: RouteDecision
    ) -> Iterator[ep.ProcessingResponse]:
        """The replies carrying the pick: header and metadata (and the body back, in full
        duplex)."""
        exchange.decision = decision
        common = self._strip_internal()
        common.header_mutation.set_headers.append(
            _set_header(DESTINATION_KEY, decision.destination)
        )
        if decision.prefill is not None:
            common.header_mutation.set_headers.append(
                _set_header("x-prefiller-host-port", decision.prefill.address)
            )
        metadata = route_metadata(
            decision.destination, decision.prefill.address if decision.prefill else None
        )
        if exchange.full_duplex:
            body = bytes(exchange.body) if decision.body is None else decision.body
            if decision.body is not None:  # a model rewrite: the length of its body
                set_content_length(common, len(body))
            yield ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
            )
            yield ep.ProcessingResponse(
                request_body=ep.BodyResponse(
                    response=ep.CommonResponse(
                        body_mutation=ep.BodyMutation(
                            streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=True)
                        )
                    )
                )
            )
        else:
            if decision.body is not None:  # a model rewrite: its body, and that body's length
                set_body(common, decision.body)
            yield ep.ProcessingResponse(
                request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata
            )
        exchange.body = bytearray()

    @staticmethod
    def _strip_internal() -> ep.CommonResponse:
        common = ep.CommonResponse()
        common.header_mutation.remove_headers.extend(INTERNAL_HEADERS)
        return common

    def _complete(self, exchange: _Exchange, ok: bool) -> None:
        if exchange.decision is None or exchange.done:
            return
        exchange.done = True
        served = exchange.served or exchange.decision.pods[0].address
        self.router.complete(exchange.key, served, ok and 200 <= exchange.status < 300)

    def finish(self, exchange: _Exchange) -> None:
        """The stream ended: a routed request without a successful end failed."""
        if exchange.decision is not None and not exchange.done:
            exchange.done = True
            self.router.complete(exchange.key, None, False)


def _served(message: ep.ProcessingRequest) -> str | None:
    namespaces = message.metadata_context.filter_metadata
    if DESTINATION_NAMESPACE in namespaces:
        fields = namespaces[DESTINATION_NAMESPACE].fields
        if SERVED_KEY in fields:
            return fields[SERVED_KEY].string_value or None
    return None


class _EppStream:
    """One EPP stream: its request's messages in, replies out as the protocol asks."""

    __slots__ = ("_cancelled", "_exchange", "_handler")

    def __init__(self, handler: GatewayHandler, trace: Metadata = ()) -> None:
        self._handler = handler
        self._exchange = _Exchange(trace=trace)
        self._cancelled = False

    def on_message(self, message: ep.ProcessingRequest) -> Answer | Future[Answer]:
        if message.WhichOneof("request") != "request_body":
            return self._answer(message)
        body = message.request_body
        if body.end_of_stream and len(self._exchange.body) + len(body.body) >= OFF_LOOP_BODY_BYTES:
            return run_off_loop(lambda: self._body(message))
        return self._body(message)

    def _body(self, message: ep.ProcessingRequest) -> Answer:
        """A body message's answer: now, later (routing off the loop), or a held
        request's longer message timeout now and the pick later."""
        try:
            replies = self._handler.on_request_body(self._exchange, message)
        except Exception as exc:  # noqa: BLE001 - every error is answered
            return self._failed(exc)
        if not isinstance(replies, Future):
            return Answer(replies, end=self._exchange.done)
        later = then(replies, self._replies)
        held = self._exchange.held
        if held is None:
            return Answer(later=later)
        if self._cancelled:  # cancelled while routing off the loop: see on_cancel
            held.cancel()
        return Answer((hold_response(held),), later=later)

    def _answer(self, message: ep.ProcessingRequest) -> Answer:
        return self._replies(lambda: list(self._handler.handle(self._exchange, message)))

    def _replies(self, replies: Callable[[], list[ep.ProcessingResponse]]) -> Answer:
        try:
            return Answer(replies(), end=self._exchange.done)
        except CancelledError:  # the stream cancelled the hold: nobody to answer
            raise
        except Exception as exc:  # noqa: BLE001 - every error is answered
            return self._failed(exc)

    def _failed(self, exc: Exception) -> Answer:
        """An error ends the stream with its reply; any but an ``ExtProcError`` is a bug,
        logged (call it from the ``except`` block, for the trace) and answered 500."""
        if isinstance(exc, ExtProcError):
            return Answer((error_response(exc),), end=True)
        log.exception("request %s: unexpected error while routing", self._exchange.request_id)
        return Answer((internal_error_response(self._exchange.request_id),), end=True)

    def on_input_end(self) -> Answer:
        return Answer(end=True)

    def on_cancel(self) -> None:
        # Set before looking at the hold, which a thread routing off the loop may set
        # meanwhile (and then looks at this): either side cancels it.
        self._cancelled = True
        if self._exchange.held is not None:
            self._exchange.held.cancel()  # out of the queue: never routed

    def on_close(self, delivered: bool) -> None:
        if not delivered:
            log.debug("request %s: ext_proc stream ended early", self._exchange.request_id)
        self._handler.finish(self._exchange)


def epp_process(router: Router) -> Method:
    """``Process`` for Endpoint Picker Protocol gateways: messages both ways, as they come."""
    handler = GatewayHandler(router)
    return process_method(handler.open, handler.open)
