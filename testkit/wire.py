"""What the gRPC-layer tests and e2e share: four pods, a one-round ext_proc and access-log
client, a server for either protocol, the messages Envoy sends, and reading extproc's
answers."""

from __future__ import annotations

from typing import Self

import grpc
import orjson
from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import duration_pb2, struct_pb2, wrappers_pb2

from extproc.routing.router import Router
from extproc.wire.epp import epp_process
from extproc.wire.protocol import (
    ACCESS_LOG_SERVICE,
    ATTRIBUTES_KEY,
    EXT_PROC_SERVICE,
    SUBSET_HINT_KEY,
    SUBSET_HINT_NAMESPACE,
)
from extproc.wire.server import make_grpc_server
from testkit.factories import make_pod
from testkit.waiting import wait_until

PODS = [make_pod(f"p{i}", port=8100 + i) for i in range(4)]
BODY = orjson.dumps({"model": "m", "prompt": "a prompt long enough to hash " * 4})
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


class Client:
    def __init__(self, port: int, channel: grpc.Channel | None = None) -> None:
        self.channel = channel or grpc.insecure_channel(f"127.0.0.1:{port}")
        self.process = self.channel.stream_unary(
            f"/{EXT_PROC_SERVICE}/Process",
            request_serializer=ep.ProcessingRequest.SerializeToString,
            response_deserializer=ep.ProcessingResponse.FromString,
        )
        self.logs = self.channel.stream_unary(
            f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs",
            request_serializer=als_pb2.StreamAccessLogsMessage.SerializeToString,
            response_deserializer=als_pb2.StreamAccessLogsResponse.FromString,
        )

    def send_body(
        self,
        body: object,
        *,
        path: str = "/v1/completions",
        request_id: str = "r1",
        session: str | None = None,
        subset: list[str] | None = None,
    ) -> ep.ProcessingResponse:
        msg = ep.ProcessingRequest(
            request_body=ep.HttpBody(
                body=body if isinstance(body, bytes) else orjson.dumps(body), end_of_stream=True
            )
        )
        attrs = msg.attributes[ATTRIBUTES_KEY]
        attrs.fields["request.url_path"].string_value = path
        attrs.fields["request.id"].string_value = request_id
        if session:
            attrs.fields["request.headers['x-session-id']"].string_value = session
        if subset is not None:
            hint = msg.metadata_context.filter_metadata[SUBSET_HINT_NAMESPACE]
            hint.fields[SUBSET_HINT_KEY].list_value.values.extend(
                struct_pb2.Value(string_value=a) for a in subset
            )
        return self.process(iter([msg]), timeout=5)

    def log(self, *entries: accesslog_pb2.HTTPAccessLogEntry) -> None:
        msg = als_pb2.StreamAccessLogsMessage(
            identifier=als_pb2.StreamAccessLogsMessage.Identifier(log_name="extproc")
        )
        msg.http_logs.log_entry.extend(entries)
        self.logs(iter([msg]), timeout=5)


def log_entry(
    request_id: str,
    served: str,
    *,
    code: int = 200,
    ended: bool = True,
    metadata: struct_pb2.Struct | None = None,
    first_byte_ns: int | None = None,
    **flags: bool,
) -> accesslog_pb2.HTTPAccessLogEntry:
    """An access-log entry as Envoy writes it; ``metadata``: the route reply's dynamic
    metadata, which Envoy brings back in the entry."""
    host, port = served.rsplit(":", 1)
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.request.request_id = request_id
    entry.response.response_code.CopyFrom(wrappers_pb2.UInt32Value(value=code))
    cp = entry.common_properties
    cp.upstream_remote_address.CopyFrom(
        address_pb2.Address(
            socket_address=address_pb2.SocketAddress(address=host, port_value=int(port))
        )
    )
    if ended:
        cp.time_to_last_downstream_tx_byte.CopyFrom(duration_pb2.Duration(nanos=1000))
    if first_byte_ns is not None:
        cp.time_to_first_upstream_rx_byte.CopyFrom(duration_pb2.Duration(nanos=first_byte_ns))
    if metadata is not None:
        for namespace, value in metadata.fields.items():
            cp.metadata.filter_metadata[namespace].CopyFrom(value.struct_value)
    for name, value in flags.items():
        setattr(cp.response_flags, name, value)
    return entry


def destination(resp: ep.ProcessingResponse) -> list[str]:
    value = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"
    ]
    addresses: str = value.string_value
    return addresses.split(",")


def error_of(resp: ep.ProcessingResponse) -> tuple[int, dict[str, object]]:
    imm = resp.immediate_response
    headers = {h.header.key: h.header.raw_value for h in imm.headers.set_headers}
    assert headers["content-type"] == b"application/json"
    return imm.status.code, orjson.loads(imm.body)["error"]


def headers(
    path: str = "/v1/completions", rid: str = "r1", *, eos: bool = False, duplex: bool = False
) -> ep.ProcessingRequest:
    pairs = [(":path", path), (":method", "POST"), ("x-request-id", rid)]
    msg = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
            ),
            end_of_stream=eos,
        )
    )
    if duplex:
        msg.protocol_config.request_body_mode = FULL_DUPLEX
    return msg


def body(data: bytes = BODY, *, eos: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=eos))


def wait_settled(router: Router) -> None:
    """Until nothing awaits an end and nothing counts in flight (the loop closes streams a
    moment after the client sees their status)."""
    wait_until(
        lambda: len(router.pending) == 0 and not router.in_flight.snapshot(),
        what=lambda: (
            f"settled: pending {len(router.pending)}, in flight {router.in_flight.snapshot()}"
        ),
    )


class Server:
    """A real gRPC server for one protocol, with a stream-stream and a raw client."""

    def __init__(self, protocol: str, router: Router, kind: str, max_streams: int = 32) -> None:
        self.protocol = protocol
        self.router = router
        self.server, self.port = make_grpc_server(
            router,
            "127.0.0.1:0",
            process=epp_process(router) if protocol == "epp" else None,
            max_streams=max_streams,
            max_message_bytes=4 * 1024 * 1024,
            server_kind=kind,
        )
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.one_round = Client(self.port)
        self.bidi = self.channel.stream_stream(
            f"/{EXT_PROC_SERVICE}/Process",
            request_serializer=ep.ProcessingRequest.SerializeToString,
            response_deserializer=ep.ProcessingResponse.FromString,
        )
        self.raw = self.channel.stream_stream(f"/{EXT_PROC_SERVICE}/Process")

    def exchange(self, messages: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
        return list(self.bidi(iter(messages), timeout=5))

    def close(self) -> None:
        self.channel.close()
        self.one_round.channel.close()
        self.server.stop(0).wait(2)  # bounded: grpcio may miss the event (see test_serve)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def routed_body(rid: str, data: bytes = BODY) -> ep.ProcessingRequest:
    """The one-round message: the whole body, path and request id as attributes."""
    msg = body(data)
    fields = msg.attributes["envoy.filters.http.ext_proc"].fields
    fields["request.url_path"].string_value = "/v1/completions"
    fields["request.id"].string_value = rid
    return msg
