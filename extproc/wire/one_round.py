"""ext_proc ``Process`` as extproc's own Envoy config drives it: one message each way.

Envoy skips the request headers and sends the buffered body with the attributes extproc
needs (path, request id, session header); ``RouteHandler.process`` answers with one reply
and the OK status together: the ordered pod list in dynamic metadata
``envoy.lb/x-gateway-destination-endpoint``, or an ``ImmediateResponse`` carrying the
OpenAI-style JSON error (``envoy/README.md``). Every error is answered, never raised
into the loop; nothing here knows a plugin.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.errors import BadRequest, ExtProcError
from extproc.memo import FifoMemo
from extproc.routing.router import Router
from extproc.wire.ext_proc import (
    OFF_LOOP_BODY_BYTES,
    continue_response,
    error_response,
    internal_error_response,
    process_method,
    route_response,
    subset_hint,
)
from extproc.wire.grpc_loop import Answer, Method, run_off_loop
from extproc.wire.protocol import (
    ATTRIBUTES_KEY,
    PATH_ATTRIBUTE,
    REQUEST_ID_ATTRIBUTE,
    header_attribute,
)
from extproc.wire.record_metadata import record_reply

log = logging.getLogger("extproc.wire")


class RouteHandler:
    """The one-round ``Process`` logic over one ``Router``: a buffered body -> a reply."""

    def __init__(self, router: Router) -> None:
        self.router = router
        # Route replies serialized once per destination list (and prefill pod): the
        # lists repeat (the model's pods, best first), and building one is not free.
        self._replies: FifoMemo[tuple[str, str | None], bytes] = FifoMemo(4096)
        self._session_attribute = (
            header_attribute(router.session_header) if router.session_header else None
        )

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
                return continue_response(kind), None
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
            if decision.record is not None:
                reply += record_reply(decision, decision.record, self.router.replica_id)
            return reply, request_id or None
        except ExtProcError as exc:
            log.debug("request %s: %s %s", request_id, exc.http_status, exc.message)
            return error_response(exc), None
        except Exception:
            log.exception("request %s: unexpected error while routing", request_id)
            return internal_error_response(request_id), None


class _OneRoundStream:
    """One ``Process`` stream: one message, one reply."""

    __slots__ = ("_handler", "_routed")

    def __init__(self, handler: RouteHandler) -> None:
        self._handler = handler
        self._routed: str | None = None

    def on_message(self, message: ep.ProcessingRequest) -> Answer | Future[Answer]:
        if len(message.request_body.body) >= OFF_LOOP_BODY_BYTES:
            return run_off_loop(lambda: self._route(message))
        return self._route(message)

    def _route(self, message: ep.ProcessingRequest) -> Answer:
        reply, self._routed = self._handler.process(message)
        return Answer((reply,), end=True)

    def on_input_end(self) -> Answer:
        return Answer((ep.ProcessingResponse(),), end=True)

    def on_close(self, delivered: bool) -> None:
        if not delivered and self._routed is not None:
            # Envoy stopped waiting (message timeout: a 504 or a fail-open route; or the
            # client left): no access-log entry will come for this route.
            self._handler.router.abandon(self._routed)


def one_round_process(handler: RouteHandler) -> Method:
    """``Process`` for extproc's own Envoy config: one message each way."""
    return process_method(lambda: _OneRoundStream(handler))
