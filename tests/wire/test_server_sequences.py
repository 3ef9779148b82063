"""Malformed ext_proc message sequences, straight to the gRPC server, both protocols.

Envoy never sends most of these; a misconfigured gateway, a proxy in between or a
client on the port might. Every sequence must end in a reply or a clean gRPC status,
leave nothing pending or in flight, and leave the server routing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.routing.router import Router
from extproc.wire.epp import GatewayHandler
from extproc.wire.ext_proc import OFF_LOOP_BODY_BYTES
from extproc.wire.grpc_loop import Answer
from extproc.wire.protocol import EXT_PROC_SERVICE
from testkit.factories import PREFIX_ONLY, make_scheduler
from testkit.waiting import wait_until
from testkit.wire import (
    PODS,
    Server,
    body,
    destination,
    error_of,
    headers,
    log_entry,
    routed_body,
    wait_settled,
)


def response_headers(status: str = "200", *, eos: bool = False) -> ep.ProcessingRequest:
    hv = base_pb2.HeaderValue(key=":status", raw_value=status.encode())
    return ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[hv]), end_of_stream=eos)
    )


def response_body(*, eos: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: x\n\n", end_of_stream=eos))


def trailers(kind: str) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(**{kind: ep.HttpTrailers()})


def new_router() -> Router:
    return Router(make_scheduler(PREFIX_ONLY), PODS, registry=CollectorRegistry())


@pytest.fixture(params=["one-round", "epp"])
def server(request: pytest.FixtureRequest, server_kind: str) -> Iterator[Server]:
    with Server(request.param, new_router(), server_kind) as s:
        yield s


def still_routes(s: Server) -> None:
    """The server answers a good request with a route (and forgets it again)."""
    if s.protocol == "epp":
        replies = s.exchange([headers(rid="check"), body()])
        assert [r for r in replies if r.dynamic_metadata.fields], replies
    else:
        assert destination(s.one_round.process(iter([routed_body("check")]), timeout=5))
        s.router.complete("check", None, False)
    wait_settled(s.router)


def kinds(replies: list[ep.ProcessingResponse]) -> list[str | None]:
    return [r.WhichOneof("response") for r in replies]


# -- the one-round protocol ------------------------------------------------------------

ONE_ROUND = {
    "empty-stream": ([], [None]),
    "headers-only": ([headers(eos=True)], ["request_headers"]),
    "response-headers-first": ([response_headers()], ["response_headers"]),
    "response-body-first": ([response_body()], ["response_body"]),
    "request-trailers-first": ([trailers("request_trailers")], ["request_trailers"]),
    "response-trailers-first": ([trailers("response_trailers")], ["response_trailers"]),
    "body-not-buffered": ([body(eos=False)], ["immediate_response"]),
    "body-without-attributes": ([body()], ["immediate_response"]),
}


@pytest.mark.parametrize("case", list(ONE_ROUND))
def test_one_round_malformed_sequences_get_an_answer(case: str, server_kind: str) -> None:
    with Server("one-round", new_router(), server_kind) as s:
        messages, expected = ONE_ROUND[case]
        reply = s.one_round.process(iter(messages), timeout=5)
        assert [reply.WhichOneof("response")] == expected
        if expected == ["immediate_response"]:
            status, error = error_of(reply)
            assert status == 400 and error["code"] in {"body_not_buffered", "unsupported_endpoint"}
        wait_settled(s.router)
        still_routes(s)


def test_one_round_reads_one_message_and_ignores_the_rest(server_kind: str) -> None:
    with Server("one-round", new_router(), server_kind) as s:
        reply = s.one_round.process(
            iter([routed_body("two"), body(b"{junk"), response_headers()]), timeout=5
        )
        assert destination(reply)
        assert len(s.router.pending) == 1


# -- the Endpoint Picker Protocol ------------------------------------------------------

EPP = {
    "body-before-headers": ([body()], ["immediate_response"], 400),
    "headers-without-body": ([headers(eos=True)], ["immediate_response"], 400),
    "headers-then-nothing": ([headers()], ["request_headers"], None),
    "buffered-body-in-pieces": (
        [headers(), body(b'{"model":', eos=False)],
        ["request_headers", "immediate_response"],
        400,
    ),
    "response-before-request": (
        [response_headers(), response_body()],
        ["response_headers", "response_body"],
        None,
    ),
    "trailers-only": ([trailers("request_trailers")], ["request_trailers"], None),
    "headers-twice": (
        [headers(rid="a"), headers(rid="b"), body(), response_headers(), response_body()],
        ["request_headers", "request_headers", "request_body", "response_headers", "response_body"],
        None,
    ),
    "bad-body": ([headers(), body(b"{nope")], ["request_headers", "immediate_response"], 400),
    "stream-ends-after-routing": ([headers(), body()], ["request_headers", "request_body"], None),
    "error-status-response": (
        [headers(), body(), response_headers("503"), response_body()],
        ["request_headers", "request_body", "response_headers", "response_body"],
        None,
    ),
    "messages-after-the-end": (
        [headers(), body(), response_headers(eos=True), response_body(), body()],
        ["request_headers", "request_body", "response_headers"],
        None,
    ),
    "duplex-body-never-ends": (
        [headers(duplex=True), body(b'{"model"', eos=False), body(b':"m"', eos=False)],
        [],
        None,
    ),
}


@pytest.mark.parametrize("case", list(EPP))
def test_epp_malformed_sequences_get_an_answer_and_leave_nothing_behind(
    case: str, server_kind: str
) -> None:
    with Server("epp", new_router(), server_kind) as s:
        messages, expected, status = EPP[case]
        replies = s.exchange(messages)
        assert kinds(replies) == expected
        if status is not None:
            assert error_of(replies[-1])[0] == status
        wait_settled(s.router)
        still_routes(s)


def test_epp_records_only_a_2xx_response_that_ended(server_kind: str) -> None:
    router = new_router()
    with Server("epp", router, server_kind) as s:
        s.exchange([headers(rid="fail"), body(), response_headers("503"), response_body()])
        s.exchange([headers(rid="cut"), body(), response_headers(), response_body(eos=False)])
        assert router.metrics.completions.labels("recorded").value == 0
        s.exchange([headers(rid="ok"), body(), response_headers(), response_body()])
        assert router.metrics.completions.labels("recorded").value == 1


message_kinds = st.sampled_from(
    ["headers", "headers-eos", "duplex-headers", "body", "partial-body", "bad-body",
     "response-headers", "response-503", "response-body", "response-body-eos",
     "request-trailers", "response-trailers"]
)  # fmt: skip
MAKE = {
    "headers": lambda i: headers(rid=f"h{i}"),
    "headers-eos": lambda i: headers(rid=f"h{i}", eos=True),
    "duplex-headers": lambda i: headers(rid=f"h{i}", duplex=True),
    "body": lambda i: body(),
    "partial-body": lambda i: body(b'{"model":"m",', eos=False),
    "bad-body": lambda i: body(b"\xff"),
    "response-headers": lambda i: response_headers(),
    "response-503": lambda i: response_headers("503"),
    "response-body": lambda i: response_body(eos=False),
    "response-body-eos": lambda i: response_body(),
    "request-trailers": lambda i: trailers("request_trailers"),
    "response-trailers": lambda i: trailers("response_trailers"),
}


@settings(max_examples=300, deadline=None)
@given(st.lists(message_kinds, max_size=8))
def test_any_epp_sequence_is_answered_and_leaves_nothing_in_flight(sequence: list[str]) -> None:
    router = new_router()
    stream = GatewayHandler(router).open()
    replies: list[object] = []
    for i, kind in enumerate(sequence):
        answer = stream.on_message(MAKE[kind](i))
        assert isinstance(answer, Answer)  # small bodies are answered on the spot
        replies.extend(answer.replies)
        if answer.end:
            break
    else:
        replies.extend(stream.on_input_end().replies)
    stream.on_close(delivered=True)
    assert all(isinstance(r, ep.ProcessingResponse) for r in replies)
    assert len(router.pending) == 0 and not router.in_flight.snapshot()


# -- gRPC-level abuse, both protocols ---------------------------------------------------


def test_bytes_that_are_not_a_message_get_a_grpc_error(server: Server) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(server.raw(iter([b"\xff\xff\xff not protobuf"]), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "the request is not a ProcessingRequest message"
    still_routes(server)


def test_a_message_over_the_limit_is_refused(server: Server) -> None:
    with pytest.raises(grpc.RpcError) as info:
        server.exchange([body(b"x" * (5 * 1024 * 1024))])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    still_routes(server)


class Errors(logging.Handler):
    """ERROR records of extproc's loggers, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def errors() -> Iterator[Errors]:
    handler = Errors()
    logger = logging.getLogger("extproc")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def test_cancelled_streams_log_no_error_and_leave_nothing(server: Server, errors: Errors) -> None:
    """Envoy cancels the stream when its message timeout passes or the client leaves."""
    gate = threading.Event()

    def stalled() -> Iterator[ep.ProcessingRequest]:
        if server.protocol == "epp":  # routed, then the stream is cut before the response
            yield headers(rid="cancelled")
            yield body()
        gate.wait(5)

    call = server.bidi(stalled(), timeout=5)
    if server.protocol == "epp":  # cut once routed
        wait_until(lambda: len(server.router.pending) == 1)
    else:
        wait_until(lambda: server.server.open_streams == 1)
    call.cancel()
    gate.set()
    wait_settled(server.router)
    time.sleep(0.1)
    assert errors.messages == []
    still_routes(server)


def test_a_route_the_caller_gave_up_on_is_forgotten(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Envoy's message timeout passed while extproc was routing (504, or fail-open): no
    access-log entry will ever come for it, so it must not stay pending and in flight."""
    route = server.router.route_or_defer
    gave_up, routed = threading.Event(), threading.Event()

    def slow_route(*args: object, **kwargs: object) -> object:
        gave_up.wait(10)  # routing ends only once the caller has gone
        try:
            return route(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            routed.set()

    monkeypatch.setattr(server.router, "route_or_defer", slow_route)
    messages = [headers(rid="late"), body()] if server.protocol == "epp" else [routed_body("late")]
    with pytest.raises(grpc.RpcError) as info:
        list(server.bidi(iter(messages), timeout=0.1))
    gave_up.set()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert routed.wait(10)  # the late route is done: now it must be forgotten
    wait_settled(server.router)
    monkeypatch.undo()
    still_routes(server)


def test_a_body_over_a_mebibyte_is_routed_off_the_loop(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routing a big body takes long (a quarter of a million chat messages: 0.7 s); it
    runs on a worker thread, and requests arriving meanwhile are routed at once. The big
    route is held until the quick one is answered: routed on the loop, the quick one
    would wait out its gRPC deadline instead."""
    route = server.router.route_or_defer
    routing_big, release = threading.Event(), threading.Event()

    def held_when_big(path: str, data: bytes, **kwargs: object) -> object:
        if len(data) >= OFF_LOOP_BODY_BYTES:
            routing_big.set()
            release.wait(10)
        return route(path, data, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(server.router, "route_or_defer", held_when_big)
    big = orjson.dumps({"model": "m", "prompt": "x" * OFF_LOOP_BODY_BYTES})
    epp = server.protocol == "epp"
    with ThreadPoolExecutor(1) as pool:
        try:
            late = pool.submit(
                server.exchange,
                [headers(rid="big"), body(big)] if epp else [routed_body("big", big)],
            )
            assert routing_big.wait(10)
            quick = server.exchange(
                [headers(rid="quick"), body()] if epp else [routed_body("quick")]
            )
            assert not late.done()  # answered while the big one was still being routed
        finally:
            release.set()
        replies = late.result(timeout=10)
    assert [destination(r) for r in quick + replies if r.dynamic_metadata.fields]
    assert len([r for r in replies if r.dynamic_metadata.fields]) == 1
    if not epp:
        for rid in ("big", "quick"):
            server.router.complete(rid, None, False)
    wait_settled(server.router)


def test_a_repeated_request_id_does_not_leak_in_flight(server_kind: str) -> None:
    """Envoy generates request ids, but a gateway may keep the client's: the same id
    routed twice before its end must not leave the first counted in flight for ever."""
    with Server("one-round", new_router(), server_kind) as s:
        for _ in range(2):
            assert destination(s.one_round.process(iter([routed_body("dup")]), timeout=5))
        s.router.complete("dup", None, False)
        wait_settled(s.router)


def test_epp_streams_with_the_same_request_id_record_each_their_own(server_kind: str) -> None:
    router = new_router()
    with Server("epp", router, server_kind) as s:
        gate = threading.Event()

        def first() -> Iterator[ep.ProcessingRequest]:
            yield headers(rid="same")
            yield body(orjson.dumps({"model": "m", "prompt": "first prompt " * 10}))
            gate.wait(5)
            yield response_headers()
            yield response_body()

        call = s.bidi(first(), timeout=10)
        assert next(call).WhichOneof("response") == "request_headers"
        assert next(call).WhichOneof("response") == "request_body"
        s.exchange(
            [
                headers(rid="same"),
                body(orjson.dumps({"model": "m", "prompt": "second prompt " * 10})),
                response_headers(),
                response_body(),
            ]
        )
        gate.set()
        assert len(list(call)) == 2
        assert router.metrics.completions.labels("recorded").value == 2
        wait_settled(router)


def test_epp_full_duplex_body_over_the_limit_is_refused_while_it_streams(
    server_kind: str,
) -> None:
    """FULL_DUPLEX_STREAMED has no Envoy buffer limit: extproc must not buffer without one."""
    router = Router(
        make_scheduler(PREFIX_ONLY), PODS, registry=CollectorRegistry(), max_body_bytes=1000
    )
    with Server("epp", router, server_kind) as s:

        def chunks() -> Iterator[ep.ProcessingRequest]:
            yield headers(duplex=True)
            for _ in range(50):  # 30 KB in all, never ending: the answer must come early
                yield body(b" " * 600, eos=False)

        replies = list(s.bidi(chunks(), timeout=5))
        assert kinds(replies) == ["immediate_response"]
        status, error = error_of(replies[0])
        assert status == 413 and error["code"] == "body_too_large"
        wait_settled(router)


@contextmanager
def held_streams(channel: grpc.Channel, count: int, method: str) -> Iterator[list[grpc.Future]]:
    """``count`` long-lived streams that send nothing until the block ends (Envoy's
    access-log streams, or EPP requests whose responses are still streaming)."""
    gate = threading.Event()
    held_s = 60.0  # far past any test's body, even on a loaded machine: they end with it

    def idle() -> Iterator[bytes]:
        gate.wait(held_s)
        return
        yield b""

    call = channel.stream_unary(method)
    try:
        yield [call.future(idle(), timeout=held_s) for _ in range(count)]
    finally:
        gate.set()


ACCESS_LOG = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"


def test_open_access_log_streams_do_not_hold_up_routing(server_kind: str) -> None:
    """Envoy keeps one access-log stream per worker thread, for ever: a stream holds no
    thread in the loop server, so however many are open, routing goes on."""
    with (
        Server("one-round", new_router(), server_kind, max_streams=64) as s,
        held_streams(s.channel, 48, ACCESS_LOG) as held,
    ):
        wait_until(lambda: s.server.open_streams == 48)
        # held up, the call would wait out its deadline (DEADLINE_EXCEEDED)
        assert destination(s.one_round.process(iter([routed_body("r")]), timeout=20))
        assert not any(f.done() for f in held)
        s.router.complete("r", None, False)


@pytest.mark.parametrize("protocol", ["one-round", "epp"])
def test_streams_beyond_the_limit_are_refused_at_once_not_queued(
    protocol: str, server_kind: str
) -> None:
    """Past --max-streams a new stream fails fast (Envoy answers or fails open) instead
    of waiting out the message timeout; the held ones still finish."""
    with Server(protocol, new_router(), server_kind, max_streams=4) as s:
        with held_streams(s.channel, 4, f"/{EXT_PROC_SERVICE}/Process") as held:
            wait_until(lambda: s.server.open_streams == 4)
            assert not any(f.done() for f in held)
            with pytest.raises(grpc.RpcError) as info:  # queued, it would time out instead
                list(s.bidi(iter([headers(rid="fifth"), body()]), timeout=20))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-streams" in (info.value.details() or "")
        wait_until(lambda: s.server.open_streams == 0)
        wait_settled(s.router)
        still_routes(s)


def test_a_draining_server_refuses_new_routes_but_takes_access_logs(server_kind: str) -> None:
    """During the drain Envoy must fail the new requests fast (500, or fail open) while
    the access logs of those in flight still arrive and are recorded."""
    with Server("one-round", new_router(), server_kind) as s:
        served = destination(s.one_round.process(iter([routed_body("in-flight")]), timeout=5))[0]
        s.server.drain(keep=[ACCESS_LOG])
        with pytest.raises(grpc.RpcError) as info:
            s.one_round.process(iter([routed_body("late")]), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        s.one_round.log(log_entry("in-flight", served))
        wait_settled(s.router)
        assert s.router.metrics.outcome["recorded"].value == 1
