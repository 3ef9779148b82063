"""The gRPC servers on their own: streams, errors, limits, slow answers, stop (the loop
server and its public fallback alike); and the guard choosing between them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from importlib.metadata import requires, version
from typing import Any, ClassVar

import grpc
import pytest
from packaging.requirements import Requirement
from prometheus_client import CollectorRegistry

from extproc.errors import ConfigError
from extproc.routing.router import Router
from extproc.wire import grpc_loop, server
from extproc.wire.grpc_loop import Answer, LoopServer, Method, run_off_loop, self_check
from extproc.wire.grpc_public import PublicServer
from extproc.wire.server import choose_server, make_grpc_server
from testkit.factories import PREFIX_ONLY, make_scheduler
from testkit.waiting import wait_until

ECHO = "/test.Loop/Echo"


class Echo:
    """Answers each message with itself; "end" ends the stream, "boom" raises, "slow"
    is answered off the loop once ``release`` is set (``computing`` says it started).
    "later" answers "now" at once and then ``held``'s answer; "hold" waits for ``held``
    alone, and ``on_cancel`` cancels it."""

    closed: ClassVar[list[bool]] = []
    cancels: ClassVar[list[str]] = []  # the thread each on_cancel ran on
    computing = threading.Event()
    release = threading.Event()
    held: Future[Answer] = Future()

    def on_message(self, message: bytes) -> Answer | Future[Answer]:
        if message == b"boom":
            raise RuntimeError("a handler bug")
        if message == b"slow":
            return run_off_loop(slow_answer)
        if message == b"later":
            return Answer((b"now",), later=Echo.held)
        if message == b"hold":
            return Echo.held
        return Answer((message,), end=message == b"end")

    def on_input_end(self) -> Answer:
        return Answer((b"bye",), end=True)

    def on_close(self, delivered: bool) -> None:
        Echo.closed.append(delivered)

    def on_cancel(self) -> None:
        Echo.cancels.append(threading.current_thread().name)
        Echo.held.cancel()


def slow_answer() -> Answer:
    Echo.computing.set()
    Echo.release.wait(30)
    return Answer((b"slow done",))


Served = tuple[LoopServer | PublicServer, grpc.Channel]


@pytest.fixture(params=[LoopServer, PublicServer], ids=["loop", "public"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    Echo.closed = []
    Echo.cancels = []
    Echo.held = Future()
    server = request.param(
        {ECHO: Method(bytes, bytes, Echo, "bytes")},
        max_streams=8,
        options=[("grpc.so_reuseport", 0)],
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield server, channel
    channel.close()
    assert server.stop(0).wait(5)


def call(channel: grpc.Channel, *messages: bytes, method: str = ECHO) -> list[bytes]:
    return list(channel.stream_stream(method)(iter(messages), timeout=5))


def test_replies_in_order_and_the_stream_closes_when_input_ends(
    served: Served,
) -> None:
    server, channel = served
    assert call(channel, b"a", b"b") == [b"a", b"b", b"bye"]
    assert call(channel, b"a", b"end", b"ignored") == [b"a", b"end"]
    wait_until(lambda: server.open_streams == 0 and Echo.closed == [True, True])


def test_a_handler_that_raises_gets_internal_without_a_trace_and_the_server_goes_on(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    _, channel = served
    with pytest.raises(grpc.RpcError) as info:
        call(channel, b"boom")
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "Traceback" not in (info.value.details() or "")
    assert "a handler bug" in caplog.text  # logged here, not sent
    assert call(channel, b"x") == [b"x", b"bye"]


def test_an_unknown_method_is_unimplemented(served: Served) -> None:
    _, channel = served
    with pytest.raises(grpc.RpcError) as info:
        call(channel, b"x", method="/test.Loop/Nope")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_slow_answer_off_the_loop_does_not_hold_up_other_streams(
    served: Served,
) -> None:
    _, channel = served
    slow: list[list[bytes]] = []
    Echo.computing.clear()
    Echo.release.clear()
    worker = threading.Thread(target=lambda: slow.append(call(channel, b"slow")))
    worker.start()
    assert Echo.computing.wait(10)
    try:
        assert call(channel, b"quick") == [b"quick", b"bye"]
        assert not slow  # the slow one was still being computed
    finally:
        Echo.release.set()
    worker.join(30)
    assert slow == [[b"slow done", b"bye"]]


def test_an_answer_later_sends_its_replies_first_then_the_later_answer(
    served: Served,
) -> None:
    server, channel = served
    gate = threading.Event()

    def messages() -> Iterator[bytes]:
        yield b"later"
        gate.wait(5)  # the input stays open: the later answer must not wait for more
        yield b"after"

    responses = channel.stream_stream(ECHO)(messages(), timeout=10)
    assert next(responses) == b"now"  # sent before the later answer exists
    Echo.held.set_result(Answer((b"then",)))
    assert next(responses) == b"then"
    gate.set()
    assert list(responses) == [b"after", b"bye"]  # and the stream reads on after it
    wait_until(lambda: server.open_streams == 0 and Echo.closed == [True])
    assert Echo.cancels == []


def test_a_client_that_leaves_while_the_stream_waits_cancels_it_once_and_quietly(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    server, channel = served
    gate = threading.Event()

    def messages() -> Iterator[bytes]:
        yield b"later"
        gate.wait(5)

    responses = channel.stream_stream(ECHO)(messages(), timeout=10)
    try:
        assert next(responses) == b"now"
        assert server.open_streams == 1 and Echo.cancels == []
        with caplog.at_level(logging.DEBUG, "extproc.grpc"):
            responses.cancel()
            wait_until(
                lambda: server.open_streams == 0 and Echo.closed == [False],
                what=lambda: (server.open_streams, Echo.closed, Echo.cancels),
            )
    finally:
        gate.set()
    assert len(Echo.cancels) == 1 and Echo.held.cancelled()
    if isinstance(server, LoopServer):
        assert Echo.cancels == ["extproc-grpc"]  # on the loop thread
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert call(channel, b"x") == [b"x", b"bye"]  # the server goes on


def test_an_answer_cancelled_by_its_stream_ends_it_cancelled_without_a_log(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    server, channel = served
    Echo.held.cancel()
    with pytest.raises(grpc.RpcError) as info:
        call(channel, b"hold")
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    wait_until(lambda: server.open_streams == 0 and Echo.closed == [True])  # the status went
    assert Echo.cancels == []  # the client did not leave


@contextmanager
def stalled_stream(channel: grpc.Channel) -> Iterator[Any]:
    """A stream that has sent one message and got its echo, then sends nothing more."""
    gate = threading.Event()

    def stalled() -> Iterator[bytes]:
        yield b"a"
        gate.wait(5)

    responses = channel.stream_stream(ECHO)(stalled(), timeout=5)
    assert next(responses) == b"a"
    try:
        yield responses
    finally:
        gate.set()


def test_a_client_that_cancels_is_closed_as_not_delivered(
    served: Served,
) -> None:
    server, channel = served
    with stalled_stream(channel) as responses:
        responses.cancel()
    wait_until(lambda: server.open_streams == 0 and Echo.closed == [False])


def test_stop_cancels_open_streams_after_the_grace(
    served: Served,
) -> None:
    server, channel = served
    with stalled_stream(channel):
        started = time.monotonic()
        stopped = server.stop(0.3)
        assert not stopped.wait(0.1)  # the open stream keeps it running during the grace
        assert stopped.wait(30) and time.monotonic() - started >= 0.3
    # The public server closes a stream once its handler has returned, which may be just
    # after the stop is confirmed.
    wait_until(lambda: Echo.closed == [False])


@pytest.mark.parametrize("served", [LoopServer], ids=["loop"], indirect=True)
def test_a_bug_in_the_loop_is_logged_and_the_loop_goes_on(
    served: Served,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, channel = served
    on_final = grpc_loop._Call._on_final
    calls: list[object] = []

    def broken_once(self: grpc_loop._Call, event: object) -> None:
        calls.append(event)
        if len(calls) == 1:
            raise RuntimeError("a loop bug")
        on_final(self, event)

    monkeypatch.setattr(grpc_loop._Call, "_on_final", broken_once)
    assert call(channel, b"a") == [b"a", b"bye"]  # the status went out before the bug
    wait_until(lambda: "a loop bug" in caplog.text)
    assert call(channel, b"b") == [b"b", b"bye"]


# -- the guard: loop server or public server ---------------------------------------------


def test_the_installed_grpcio_is_in_the_pinned_range_and_carries_the_loop() -> None:
    """CI runs on the grpcio pyproject.toml allows; the loop is tested on that range."""
    (pin,) = [Requirement(r) for r in requires("extproc") or [] if r.startswith("grpcio")
              and Requirement(r).name == "grpcio"]  # fmt: skip
    assert version("grpcio") in pin.specifier, (version("grpcio"), str(pin.specifier))
    assert self_check() is None
    assert choose_server("auto")[0] is LoopServer


class _ServerWithoutCancel:
    """cygrpc.Server as a grpcio without ``cancel_all_calls`` would have it."""

    register_completion_queue = add_http2_port = start = request_call = shutdown = None
    destroy = None


@pytest.mark.parametrize(
    ("owner", "name", "said"),
    [
        pytest.param(grpc_loop, "cygrpc", "no grpc._cython.cygrpc", id="no-cygrpc"),
        pytest.param(
            grpc_loop.cygrpc, "SendMessageOperation", "SendMessageOperation", id="an-operation"
        ),
        pytest.param(grpc_loop.cygrpc, "Server", "Server.cancel_all_calls", id="a-method"),
    ],
)
def test_a_grpcio_without_what_the_loop_uses_fails_the_self_check(
    owner: Any, name: str, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if name == "Server":
        monkeypatch.setattr(owner, name, _ServerWithoutCancel)
    elif owner is grpc_loop:
        monkeypatch.setattr(owner, name, None)
    else:
        monkeypatch.delattr(owner, name)
    problem = self_check.__wrapped__()
    assert problem is not None and said in problem


def test_a_loop_that_does_not_serve_fails_the_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc_loop, "_SelfCheckEcho", lambda: None)  # opens no stream
    problem = self_check.__wrapped__()
    assert problem is not None and "self-check" in problem


def test_auto_falls_back_to_the_public_server_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(server, "self_check", lambda: "cygrpc lacks Server.start")
    router = Router(make_scheduler(PREFIX_ONLY), [], registry=CollectorRegistry())
    with caplog.at_level(logging.INFO, "extproc.grpc"):
        grpc_server, _ = make_grpc_server(router, "127.0.0.1:0", server_kind="auto")
    assert isinstance(grpc_server, PublicServer)
    [record] = [r for r in caplog.records if "gRPC port served by" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "public server, because cygrpc lacks Server.start" in record.getMessage()
    with pytest.raises(ConfigError, match="--grpc-server loop cannot run: cygrpc lacks"):
        choose_server("loop")
    assert choose_server("public")[0] is PublicServer
