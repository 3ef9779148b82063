"""ext_proc ``Process`` as extproc's own Envoy config drives it: one message each way.

Envoy skips the request headers and sends the buffered body with the attributes extproc
needs (path, request id, the headers it reads: session, flow control's objective and
fairness key, each passed on to the router, with the trace context Envoy sends in the
stream's metadata when it traces); ``RouteHandler.process`` answers with one reply
and the OK status together: the ordered pod list in dynamic metadata
``envoy.lb/x-gateway-destination-endpoint``, or an ``ImmediateResponse`` carrying the
OpenAI-style JSON error (``envoy/README.md``). A model rewrite's reply also carries the
new body (``body_mutation``) and its ``content-length``: Envoy 1.40 answers 500 when a
buffered body mutation's length differs from the header's. Every error is answered, never raised
into the loop; nothing here knows a plugin: a request the router wants to prepare off
the loop (``Router.route_or_defer``) is answered when its Future is done.

A request flow control holds (a ``Held``) gets two replies: at once one that extends
Envoy's message timeout past the hold (``override_message_timeout``, honoured up to the
filter's ``max_message_timeout``), then the route or the refusal when it is decided. A
stream cancelled meanwhile (the client or Envoy went away) cancels the hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future
from typing import NamedTuple

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from extproc.errors import BadRequest, ExtProcError
from extproc.memo import FifoMemo
from extproc.routing.decision import RouteDecision
from extproc.routing.flow.held import Held
from extproc.routing.router import Router
from extproc.wire.ext_proc import (
    OFF_LOOP_BODY_BYTES,
    continue_response,
    error_response,
    hold_response,
    internal_error_response,
    process_method,
    route_response,
    set_body,
    subset_hint,
    trace_context,
)
from extproc.wire.grpc_loop import Answer, Metadata, Method, run_off_loop, then
from extproc.wire.protocol import (
    ATTRIBUTES_KEY,
    HEADER_ATTRIBUTE_PREFIX,
    HEADER_ATTRIBUTE_SUFFIX,
    PATH_ATTRIBUTE,
    REQUEST_ID_ATTRIBUTE,
)
from extproc.wire.record_metadata import record_reply

log = logging.getLogger("extproc.wire")

# The reply (a route comes serialized), and the request id routed, if one was.
Routed = tuple[ep.ProcessingResponse | bytes, str | None]


class HeldRoute(NamedTuple):
    """A request flow control holds: its ``Held``, and the Future of its reply."""

    held: Held
    routed: Future[Routed]


class RouteHandler:
    """The one-round ``Process`` logic over one ``Router``: a buffered body -> a reply."""

    def __init__(self, router: Router) -> None:
        self.router = router
        # Route replies serialized once per destination list (and prefill pod): the
        # lists repeat (the model's pods, best first), and building one is not free.
        self._replies: FifoMemo[tuple[str, str | None], bytes] = FifoMemo(4096)

    def process(self, message: ep.ProcessingRequest) -> Routed:
        """The one-round ``Process`` message -> the reply (a route comes serialized), and
        the request id routed (to forget if the reply never reaches Envoy). Every error
        becomes the reply. All on the calling thread."""
        routed = self._process(message, defer=False)
        assert not isinstance(routed, Future | HeldRoute)  # only ``route_or_defer`` defers
        return routed

    def process_soon(
        self, message: ep.ProcessingRequest, trace: Metadata = (), body: bytes | None = None
    ) -> Routed | Future[Routed] | HeldRoute:
        """``process``, but the routes that need slow preparation (tokenizing) come later,
        as a Future from the router's preparing threads, and a request flow control holds
        comes with its ``Held`` (``Router.route_or_defer``). ``trace``: the stream's trace
        context, passed to the router among the headers; ``body``: the message's body if
        already read (each read copies it)."""
        return self._process(message, defer=True, trace=trace, body=body)

    def _process(
        self,
        message: ep.ProcessingRequest,
        *,
        defer: bool,
        trace: Metadata = (),
        body: bytes | None = None,
    ) -> Routed | Future[Routed] | HeldRoute:
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
                return continue_response(kind), None
            if not message.request_body.end_of_stream:
                raise BadRequest(
                    "extproc needs the whole request body (ext_proc body mode BUFFERED)",
                    code="body_not_buffered",
                )
            route = self.router.route_or_defer if defer else self.router.route
            headers = request_headers(attributes)
            headers.update(trace)
            decided = route(
                attributes[PATH_ATTRIBUTE].string_value,
                message.request_body.body if body is None else body,
                request_id=request_id or None,
                headers=headers,
                subset=subset_hint(message),
            )
        except Exception as exc:  # noqa: BLE001 - every error becomes the reply
            return _failed(request_id, exc), None
        if isinstance(decided, Future):
            routed = then(decided, lambda result: self._reply(request_id, result))
            return HeldRoute(decided, routed) if isinstance(decided, Held) else routed
        return self._reply(request_id, lambda: decided)

    def _reply(self, request_id: str, decide: Callable[[], RouteDecision]) -> Routed:
        """The route reply for ``decide()``'s decision, or the reply for its error."""
        try:
            decision = decide()
            destination = decision.destination
            prefill = decision.prefill.address if decision.prefill else None
            if decision.body is None:
                reply = self._replies.get(
                    (destination, prefill),
                    lambda: route_response(destination, prefill).SerializeToString(),
                )
            else:  # a model rewrite: the body changes too, a reply of its own
                response = route_response(destination, prefill)
                set_body(response.request_body.response, decision.body)
                reply = response.SerializeToString()
            if decision.record is not None:
                reply += record_reply(decision, decision.record, self.router.replica_id)
            return reply, request_id or None
        except CancelledError:  # the stream cancelled the hold: nobody to answer
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes the reply
            return _failed(request_id, exc), None


def request_headers(attributes: Mapping[str, struct_pb2.Value]) -> dict[str, str]:
    """The request headers Envoy sent as attributes (``request.headers['NAME']``); the
    keys are walked, a value read only for a header (each read builds a wrapper)."""
    return {
        key[_HEADER_NAME]: attributes[key].string_value
        for key in attributes
        if key.startswith(HEADER_ATTRIBUTE_PREFIX) and key.endswith(HEADER_ATTRIBUTE_SUFFIX)
    }


_HEADER_NAME = slice(len(HEADER_ATTRIBUTE_PREFIX), -len(HEADER_ATTRIBUTE_SUFFIX))


def _failed(request_id: str, exc: Exception) -> ep.ProcessingResponse:
    """The reply for an error while routing: its own for an ``ExtProcError``, else a
    logged bug answered 500 (call it from the ``except`` block, for the trace)."""
    if isinstance(exc, ExtProcError):
        log.debug("request %s: %s %s", request_id, exc.http_status, exc.message)
        return error_response(exc)
    log.exception("request %s: unexpected error while routing", request_id)
    return internal_error_response(request_id)


class _OneRoundStream:
    """One ``Process`` stream: one message, one reply (two for a held request: the longer
    message timeout first)."""

    __slots__ = ("_cancelled", "_handler", "_held", "_routed", "_trace")

    def __init__(self, handler: RouteHandler, metadata: Metadata = ()) -> None:
        self._handler = handler
        self._trace = trace_context(metadata)
        self._routed: str | None = None
        self._held: Held | None = None
        self._cancelled = False

    def on_message(self, message: ep.ProcessingRequest) -> Answer | Future[Answer]:
        body = message.request_body.body  # read once: each read copies it
        if len(body) >= OFF_LOOP_BODY_BYTES:
            return run_off_loop(
                lambda: self._answer(self._handler.process_soon(message, self._trace, body))
            )
        return self._answer(self._handler.process_soon(message, self._trace, body))

    def _answer(self, routed: Routed | Future[Routed] | HeldRoute) -> Answer:
        if isinstance(routed, HeldRoute):
            self._hold(routed.held)
            later = then(routed.routed, lambda result: self._answer(result()))
            return Answer((hold_response(routed.held),), later=later)
        if isinstance(routed, Future):
            return Answer(later=then(routed, lambda result: self._answer(result())))
        reply, self._routed = routed
        return Answer((reply,), end=True)

    def _hold(self, held: Held) -> None:
        """Keep ``held`` to cancel; cancel it now if the stream was cancelled while it was
        being made (off the loop: this and ``on_cancel`` each look at what the other set)."""
        self._held = held
        if self._cancelled:
            held.cancel()

    def on_input_end(self) -> Answer:
        return Answer((ep.ProcessingResponse(),), end=True)

    def on_cancel(self) -> None:
        self._cancelled = True
        if self._held is not None:
            self._held.cancel()  # out of the queue: never routed

    def on_close(self, delivered: bool) -> None:
        if not delivered and self._routed is not None:
            # Envoy stopped waiting (message timeout: a 504 or a fail-open route; or the
            # client left): no access-log entry will come for this route.
            self._handler.router.abandon(self._routed)


def one_round_process(handler: RouteHandler) -> Method:
    """``Process`` for extproc's own Envoy config: one message each way."""
    return process_method(
        lambda: _OneRoundStream(handler), lambda metadata: _OneRoundStream(handler, metadata)
    )
