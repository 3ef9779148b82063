"""A request flow control holds, on the wire: Envoy gets a longer message timeout at once,
then the route or the refusal (429 with Retry-After); a stream cancelled meanwhile
cancels the hold. Both protocols (one-round; EPP buffered and full duplex), both servers.
The router is real but for ``route_or_defer``, which returns a ``Held`` the test decides."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from prometheus_client import CollectorRegistry

from extproc.errors import BadRequest, ExtProcError, Overloaded
from extproc.routing.decision import RouteDecision
from extproc.routing.flow.held import Held
from extproc.routing.router import Router
from extproc.wire.ext_proc import HOLD_MARGIN_S, OFF_LOOP_BODY_BYTES, error_response
from extproc.wire.protocol import header_attribute
from testkit.factories import PREFIX_ONLY, make_scheduler
from testkit.waiting import wait_until
from testkit.wire import BODY, PODS, Server, body, destination, error_of, headers, routed_body

HOLD_S = 5.0
FLOW_HEADERS = {
    "x-gateway-inference-objective": "critical",
    "x-gateway-inference-fairness-id": "tenant-a",
    "x-session-id": "s1",
}


@dataclass
class Holding:
    """``route_or_defer`` replaced: every request is held; ``decide`` routes it for real."""

    router: Router
    held: list[Held] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    asked = threading.Event()
    route = Router.route

    def route_or_defer(self, path: str, data: bytes, **kwargs: Any) -> Held:
        self.calls.append({"path": path, "data": data, **kwargs})
        held = Held(time.monotonic() + HOLD_S, priority=0)
        self.held.append(held)
        self.asked.set()
        return held

    def decide(self) -> RouteDecision:
        call = self.calls[-1]
        decision = self.router.route(
            call["path"], call["data"], request_id=call["request_id"], headers=call["headers"]
        )
        self.held[-1].set_result(decision)
        return decision


PROTOCOLS = ["one-round", "epp-buffered", "epp-full-duplex"]


@pytest.fixture(params=PROTOCOLS)
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def served(
    protocol: str, server_kind: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Server, Holding]]:
    router = Router(make_scheduler(PREFIX_ONLY), PODS, registry=CollectorRegistry())
    holding = Holding(router)
    monkeypatch.setattr(router, "route_or_defer", holding.route_or_defer)
    with Server(protocol.split("-")[0], router, server_kind) as server:
        yield server, holding


def messages(protocol: str, data: bytes = BODY) -> list[ep.ProcessingRequest]:
    """What Envoy sends for one request: the body with its attributes (one-round), or the
    headers (every flow header among them) and the body (EPP)."""
    if protocol == "one-round":
        message = routed_body("held", data)
        fields = message.attributes["envoy.filters.http.ext_proc"].fields
        for name, value in FLOW_HEADERS.items():
            fields[header_attribute(name)].string_value = value
        return [message]
    opening = headers(rid="held", duplex=protocol == "epp-full-duplex")
    for name, value in FLOW_HEADERS.items():
        opening.request_headers.headers.headers.add(key=name, raw_value=value.encode())
    return [opening, body(data)]


class Open:
    """One ext_proc stream as Envoy keeps it: its messages sent, its input left open."""

    def __init__(self, server: Server, sent: list[ep.ProcessingRequest]) -> None:
        self._gate = threading.Event()

        def requests() -> Iterator[ep.ProcessingRequest]:
            yield from sent
            self._gate.wait(10)

        self.responses = server.bidi(requests(), timeout=10)

    def until_hold(self) -> ep.ProcessingResponse:
        """The replies up to the held request's, which must come (the headers' answer
        may come first: EPP buffered); returns the hold's."""
        for reply in self.responses:
            if reply.HasField("override_message_timeout"):
                return reply
            assert reply.WhichOneof("response") == "request_headers", reply
        raise AssertionError("the stream ended without the hold's reply")

    def take(self, count: int) -> list[ep.ProcessingResponse]:
        return [next(self.responses) for _ in range(count)]

    def close(self) -> list[ep.ProcessingResponse]:
        """The input's end, and the replies still to come."""
        self.release()
        return list(self.responses)

    def release(self) -> None:
        self._gate.set()


ROUTE_REPLIES = {"one-round": 1, "epp-buffered": 1, "epp-full-duplex": 2}


@pytest.mark.parametrize("size", ["small", "big"])
def test_a_held_request_gets_a_longer_message_timeout_at_once_then_its_route(
    served: tuple[Server, Holding], protocol: str, size: str
) -> None:
    server, holding = served
    data = (
        BODY
        if size == "small"
        else orjson.dumps({"model": "m", "prompt": "x" * OFF_LOOP_BODY_BYTES})
    )
    stream = Open(server, messages(protocol, data))
    hold = stream.until_hold()
    assert not hold.WhichOneof("response")  # nothing but the timeout: Envoy keeps waiting
    left = holding.held[-1].hold_s()
    assert (
        left + HOLD_MARGIN_S <= hold.override_message_timeout.seconds <= HOLD_S + HOLD_MARGIN_S + 1
    )
    assert FLOW_HEADERS.items() <= holding.calls[-1]["headers"].items()
    decision = holding.decide()
    replies = stream.take(ROUTE_REPLIES[protocol])
    assert [destination(r) for r in replies if r.dynamic_metadata.fields] == [
        decision.destination.split(",")
    ]
    if protocol == "epp-full-duplex":  # the body goes back after the pick
        assert replies[-1].request_body.response.body_mutation.streamed_response.end_of_stream
    assert stream.close() == []


def test_a_refused_held_request_is_a_429_with_retry_after_and_an_openai_error(
    served: tuple[Server, Holding], protocol: str
) -> None:
    server, holding = served
    stream = Open(server, messages(protocol))
    stream.until_hold()
    holding.held[-1].set_exception(
        Overloaded("waited too long in the queue", code="queue_timeout", retry_after_s=3)
    )
    (reply,) = stream.take(1)
    status, error = error_of(reply)
    assert status == 429
    assert error == {
        "message": "waited too long in the queue",
        "type": "rate_limit_error",
        "param": None,
        "code": "queue_timeout",
    }
    retry_after = [h.header for h in reply.immediate_response.headers.set_headers]
    assert [h.raw_value for h in retry_after if h.key == "retry-after"] == [b"3"]
    assert stream.close() == []


def test_a_stream_cancelled_while_held_cancels_the_hold_quietly(
    served: tuple[Server, Holding], protocol: str, caplog: pytest.LogCaptureFixture
) -> None:
    server, holding = served
    stream = Open(server, messages(protocol))
    stream.until_hold()
    with caplog.at_level(logging.DEBUG):
        stream.responses.cancel()
        wait_until(lambda: holding.held[-1].cancelled() and server.server.open_streams == 0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(server.router.pending) == 0  # nothing was routed
    stream.release()


def test_only_errors_that_say_when_to_retry_carry_retry_after() -> None:
    def header_keys(error: ExtProcError) -> list[str]:
        return [h.header.key for h in error_response(error).immediate_response.headers.set_headers]

    assert header_keys(BadRequest("no")) == ["content-type"]
    assert header_keys(Overloaded("full", code="queue_full", retry_after_s=1)) == [
        "content-type",
        "retry-after",
    ]
