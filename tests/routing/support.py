"""What the replica tests share: four pods, a router over them, one ext_proc body through the
one-round handler, and the access-log message Envoy sends with the reply's metadata."""

from __future__ import annotations

from collections.abc import Callable

from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from prometheus_client import CollectorRegistry

from extproc.routing.records import Shared, Started
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, parse_config
from extproc.scheduling.sessions import SessionStore
from extproc.wire.one_round import RouteHandler
from extproc.wire.protocol import (
    ATTRIBUTES_KEY,
    PATH_ATTRIBUTE,
    REQUEST_ID_ATTRIBUTE,
    header_attribute,
)
from testkit import wire
from testkit.factories import PREFIX_ONLY, make_pod

GEOMETRY = (64, 128)  # prefix-cache's defaults
PODS = [make_pod(f"p{i}", port=8000 + i) for i in range(4)]
PROMPT = "You are the support assistant of a very large shop. " * 40


def make_router(
    *,
    carry: bool = True,
    sessions: bool = False,
    config: str = PREFIX_ONLY,
    share: Callable[[Shared | Started], object] | None = None,
) -> Router:
    registry = CollectorRegistry()
    store = SessionStore() if sessions else None
    scheduler = build_scheduler(parse_config(config, "t.yaml"), registry, sessions=store)
    return Router(scheduler, PODS, registry=registry, carry_records=carry, share=share)


def body(prompt: str = PROMPT) -> bytes:
    return f'{{"model": "m", "prompt": "{prompt}"}}'.encode()


def process(router: Router, request_id: str, session: str | None = None) -> ep.ProcessingResponse:
    """One ext_proc body message through the one-round handler; the reply as Envoy reads it."""
    message = ep.ProcessingRequest(request_body=ep.HttpBody(body=body(), end_of_stream=True))
    attributes = message.attributes[ATTRIBUTES_KEY].fields
    attributes[PATH_ATTRIBUTE].string_value = "/v1/completions"
    attributes[REQUEST_ID_ATTRIBUTE].string_value = request_id
    if session is not None:
        attributes[header_attribute("x-session-id")].string_value = session
    reply, _ = RouteHandler(router).process(message)
    assert isinstance(reply, bytes)
    return ep.ProcessingResponse.FromString(reply)


def log_entry(
    request_id: str, served: str, metadata: struct_pb2.Struct | None, code: int = 200
) -> als_pb2.StreamAccessLogsMessage:
    """An access-log message as Envoy sends it: the reply's dynamic metadata included."""
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.append(
        wire.log_entry(request_id, served, code=code, metadata=metadata)
    )
    return message
