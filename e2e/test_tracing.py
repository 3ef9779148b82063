"""Tracing through real Envoy: a real OTLP gRPC receiver (the protocol's own generated
service) gets Envoy's request span and extproc's pick span in one trace, extproc's the
child of the ext_proc call span Envoy opened for it, with the model and the pick."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from e2e.support import MODEL, PREFIX_CONFIG, names_by_address, served_by, unique_prefix
from extproc.admin.tracing import SPAN_NAME
from extproc.sim.launch import SimPods, Stack, run_stack
from testkit.waiting import wait_until

API = "/v1/completions"
NUM_REQUESTS = 3
EXPORT_WAIT_S = 30.0  # Envoy's tracer flushes every 5 s


@dataclass(frozen=True)
class Received:
    service: str
    span: trace_pb2.Span

    @property
    def attributes(self) -> dict[str, object]:
        return {a.key: _value(a.value) for a in self.span.attributes}


def _value(value: common_pb2.AnyValue) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector that keeps every span it is sent, with its service name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Received] = []

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope in resource_spans.scope_spans:
                    self._spans.extend(Received(service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[Received]:
        with self._lock:
            return list(self._spans)


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0).wait(2)


def request_id_in_response(config: dict[str, Any]) -> dict[str, Any]:
    """Envoy answers with the x-request-id it made, which both services' spans carry."""
    listener = config["static_resources"]["listeners"][0]
    listener["filter_chains"][0]["filters"][0]["typed_config"][
        "always_set_request_id_in_response"
    ] = True
    return config


@pytest.fixture(scope="module")
def traced(sim: SimPods, receiver: tuple[Receiver, int]) -> Iterator[Stack]:
    """Envoy and extproc both tracing every request to the receiver."""
    endpoint = f"127.0.0.1:{receiver[1]}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # extproc exports within 0.1 s
        with run_stack(
            sim.as_pods(),
            config=PREFIX_CONFIG,
            envoy_options={"otlp_endpoint": endpoint, "trace_sampling": 1.0},
            extproc_args=["--otlp-endpoint", endpoint, "--trace-sampling", "1.0"],
            envoy_transform=request_id_in_response,
        ) as stack:
            yield stack


def render(trace: list[Received]) -> str:
    """A trace as an indented tree: service, span name, duration, attributes."""
    children: dict[bytes, list[Received]] = {}
    for received in trace:
        children.setdefault(received.span.parent_span_id, []).append(received)
    ids = {r.span.span_id for r in trace}
    roots = [r for r in trace if r.span.parent_span_id not in ids]
    lines: list[str] = []

    def walk(received: Received, depth: int) -> None:
        span = received.span
        ms = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
        lines.append(f"{'  ' * depth}{received.service}: {span.name} ({ms:.2f} ms)")
        for key, value in received.attributes.items():
            lines.append(f"{'  ' * depth}    {key} = {value}")
        for child in sorted(
            children.get(span.span_id, []), key=lambda r: r.span.start_time_unix_nano
        ):
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return "\n".join(lines)


def test_envoys_span_and_extprocs_pick_are_one_trace(
    traced: Stack, receiver: tuple[Receiver, int], sim: SimPods
) -> None:
    collector = receiver[0]
    addresses = {name: address for address, name in names_by_address(sim).items()}
    served: dict[str, str] = {}  # request id -> the pod's address
    with httpx.Client(base_url=traced.url, timeout=30) as client:
        for _ in range(NUM_REQUESTS):
            body = {"model": MODEL, "prompt": unique_prefix() + "question?", "max_tokens": 4}
            resp = client.post(API, json=body)
            served[resp.headers["x-request-id"]] = addresses[served_by(resp)]

    def picks() -> list[Received]:
        return [r for r in collector.spans() if r.span.name == SPAN_NAME]

    def envoy_ingress() -> dict[str, Received]:
        found = {}
        for received in collector.spans():
            guid = received.attributes.get("guid:x-request-id")
            if received.service == "envoy" and isinstance(guid, str) and guid in served:
                found[guid] = received
        return found

    wait_until(
        lambda: len(picks()) >= NUM_REQUESTS and len(envoy_ingress()) >= NUM_REQUESTS,
        EXPORT_WAIT_S,
        what=lambda: f"spans received: {[(r.service, r.span.name) for r in collector.spans()]}",
    )
    by_id = {r.span.span_id: r for r in collector.spans()}
    ingress = envoy_ingress()
    for pick in picks():
        attributes = pick.attributes
        request_id = attributes["extproc.request_id"]
        assert isinstance(request_id, str) and request_id in served
        assert pick.service == "extproc" and pick.span.kind == trace_pb2.Span.SPAN_KIND_SERVER
        assert attributes["extproc.model"] == MODEL
        assert attributes["extproc.pick.address"] == served[request_id]
        assert attributes["extproc.candidates"] == len(sim.pods)
        assert len(attributes["extproc.fallbacks"]) == 2  # type: ignore[arg-type]
        # extproc's parent is a span Envoy sent (the ext_proc call), itself under the
        # request's ingress span, all in one trace
        request = ingress[request_id]
        parent = by_id.get(pick.span.parent_span_id)
        assert parent is not None and parent.service == "envoy", render(
            [r for r in collector.spans() if r.span.trace_id == pick.span.trace_id]
        )
        assert parent.span.parent_span_id == request.span.span_id
        assert pick.span.trace_id == parent.span.trace_id == request.span.trace_id
    trace = [r for r in collector.spans() if r.span.trace_id == picks()[0].span.trace_id]
    print(render(trace))  # the docs' example trace (pytest -s)
