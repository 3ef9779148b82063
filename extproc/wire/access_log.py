"""Envoy's gRPC access log (``StreamAccessLogs``): how each routed request ended.

Envoy keeps one stream open per worker and sends an entry per request as it ends (in
batches). An entry tells whether the response **ended successfully** (2xx, no response
flag, the last byte reached the client) and which pod served it after retries; the
``Router`` then records the prompt for that pod. An entry for a request another replica
routed brings its record in the dynamic metadata (``wire.record_metadata``), read only
then; a malformed one is counted and logged, never recorded.
"""

from __future__ import annotations

import logging

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2

from extproc.routing.observe import EndTiming
from extproc.routing.records import BadRecord, Carried
from extproc.routing.router import Router
from extproc.wire.grpc_loop import Answer, Method
from extproc.wire.record_metadata import carried_record

log = logging.getLogger("extproc.wire")


class AccessLogHandler:
    """Completes routed requests from access-log entries."""

    def __init__(self, router: Router) -> None:
        self.router = router

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
        request_id = entry.request.request_id

        def carried() -> Carried | None:
            try:
                return carried_record(common.metadata, self.router.geometries)
            except BadRecord as exc:
                self.router.metrics.bad_records.labels(exc.reason).inc()
                log.warning("request %s: bad extproc.record metadata: %s", request_id, exc)
                return None

        timing = _timing(entry, code) if self.router.observers else None
        recorded = self.router.complete(request_id, served, succeeded, attempts, carried, timing)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s ended: %d %s via %s, recorded=%s",
                entry.request.request_id,
                code,
                flags or "ok",
                served,
                recorded,
            )


def _timing(entry: accesslog_pb2.HTTPAccessLogEntry, code: int) -> EndTiming:
    """The entry's times (from the request's first byte) and sizes."""
    common, request, response = entry.common_properties, entry.request, entry.response
    first = common.time_to_first_upstream_rx_byte
    last = common.time_to_last_downstream_tx_byte
    return EndTiming(
        first.seconds + first.nanos / 1e9
        if common.HasField("time_to_first_upstream_rx_byte")
        else None,
        last.seconds + last.nanos / 1e9
        if common.HasField("time_to_last_downstream_tx_byte")
        else None,
        request.request_headers_bytes + request.request_body_bytes,
        response.response_headers_bytes + response.response_body_bytes,
        code,
    )


class _AccessLogStream:
    """One ``StreamAccessLogs`` stream: no reply until the input ends."""

    __slots__ = ("_handler",)

    def __init__(self, handler: AccessLogHandler) -> None:
        self._handler = handler

    def on_message(self, message: als_pb2.StreamAccessLogsMessage) -> Answer:
        self._handler.complete(message)
        return Answer()

    def on_input_end(self) -> Answer:
        return Answer((als_pb2.StreamAccessLogsResponse(),), end=True)

    def on_close(self, delivered: bool) -> None:
        pass

    def on_cancel(self) -> None:
        pass  # never waits for a Future


def access_log_method(handler: AccessLogHandler) -> Method:
    """``StreamAccessLogs``, each stream completing through ``handler``."""
    return Method(
        parse=als_pb2.StreamAccessLogsMessage.FromString,
        serialize=als_pb2.StreamAccessLogsResponse.SerializeToString,
        open=lambda: _AccessLogStream(handler),
        name="StreamAccessLogsMessage",
    )
