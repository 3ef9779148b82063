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
from google.protobuf import duration_pb2

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
        # Each field read builds a wrapper: only those used are read, the flags last.
        common = entry.common_properties
        code = entry.response.response_code.value
        succeeded = (
            200 <= code < 300
            and common.HasField("time_to_last_downstream_tx_byte")
            and not _flagged(common)
        )
        sock = common.upstream_remote_address.socket_address
        address = sock.address
        served = f"{address}:{sock.port_value}" if address else None
        attempts = common.upstream_request_attempt_count or 1
        request_id = entry.request.request_id

        def carried() -> Carried | None:
            try:
                return carried_record(common.metadata, self.router.geometries)
            except BadRecord as exc:
                self.router.metrics.bad_records.labels(exc.reason).inc()
                log.warning("request %s: bad extproc.record metadata: %s", request_id, exc)
                return None

        timing = _timing(entry, common, code) if self.router.observers else None
        recorded = self.router.complete(request_id, served, succeeded, attempts, carried, timing)
        if log.isEnabledFor(logging.DEBUG):
            flags = [f.name for f, v in common.response_flags.ListFields() if v]
            log.debug(
                "request %s ended: %d %s via %s, recorded=%s",
                request_id,
                code,
                flags or "ok",
                served,
                recorded,
            )


def _flagged(common: accesslog_pb2.AccessLogCommon) -> bool:
    """Whether Envoy set a response flag (each is a bool, or a message when set)."""
    flagged: bool = common.HasField("response_flags") and common.response_flags.ByteSize() > 0
    return flagged


def _timing(
    entry: accesslog_pb2.HTTPAccessLogEntry, common: accesslog_pb2.AccessLogCommon, code: int
) -> EndTiming:
    """The entry's times (from the request's first byte) and sizes."""
    request, response = entry.request, entry.response
    has = common.HasField
    return EndTiming(
        _seconds(common.time_to_first_upstream_rx_byte)
        if has("time_to_first_upstream_rx_byte")
        else None,
        _seconds(common.time_to_last_downstream_tx_byte)
        if has("time_to_last_downstream_tx_byte")
        else None,
        request.request_headers_bytes + request.request_body_bytes,
        response.response_headers_bytes + response.response_body_bytes,
        code,
    )


def _seconds(duration: duration_pb2.Duration) -> float:
    seconds: float = duration.seconds + duration.nanos / 1e9
    return seconds


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
