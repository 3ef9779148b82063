"""The one-thread gRPC server on its own: streams, errors, limits, slow answers, stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, ClassVar

import grpc
import pytest

from extproc.wire import grpc_loop
from extproc.wire.grpc_loop import Answer, LoopServer, Method, run_off_loop
from tests.test_server_sequences import eventually

ECHO = "/test.Loop/Echo"


class Echo:
    """Answers each message with itself; "end" ends the stream, "boom" raises, "slow"
    is answered off the loop once ``release`` is set (``computing`` says it started)."""

    closed: ClassVar[list[bool]] = []
    computing = threading.Event()
    release = threading.Event()

    def on_message(self, message: bytes) -> Answer | Future[Answer]:
        if message == b"boom":
            raise RuntimeError("a handler bug")
        if message == b"slow":
            return run_off_loop(slow_answer)
        return Answer((message,), end=message == b"end")

    def on_input_end(self) -> Answer:
        return Answer((b"bye",), end=True)

    def on_close(self, delivered: bool) -> None:
        Echo.closed.append(delivered)


def slow_answer() -> Answer:
    Echo.computing.set()
    Echo.release.wait(30)
    return Answer((b"slow done",))


@pytest.fixture
def served() -> Iterator[tuple[LoopServer, grpc.Channel]]:
    Echo.closed = []
    server = LoopServer(
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
    served: tuple[LoopServer, grpc.Channel],
) -> None:
    server, channel = served
    assert call(channel, b"a", b"b") == [b"a", b"b", b"bye"]
    assert call(channel, b"a", b"end", b"ignored") == [b"a", b"end"]
    assert eventually(lambda: server.open_streams == 0 and Echo.closed == [True, True])


def test_a_handler_that_raises_gets_internal_without_a_trace_and_the_server_goes_on(
    served: tuple[LoopServer, grpc.Channel], caplog: pytest.LogCaptureFixture
) -> None:
    _, channel = served
    with pytest.raises(grpc.RpcError) as info:
        call(channel, b"boom")
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "Traceback" not in (info.value.details() or "")
    assert "a handler bug" in caplog.text  # logged here, not sent
    assert call(channel, b"x") == [b"x", b"bye"]


def test_an_unknown_method_is_unimplemented(served: tuple[LoopServer, grpc.Channel]) -> None:
    _, channel = served
    with pytest.raises(grpc.RpcError) as info:
        call(channel, b"x", method="/test.Loop/Nope")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_slow_answer_off_the_loop_does_not_hold_up_other_streams(
    served: tuple[LoopServer, grpc.Channel],
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
    served: tuple[LoopServer, grpc.Channel],
) -> None:
    server, channel = served
    with stalled_stream(channel) as responses:
        responses.cancel()
    assert eventually(lambda: server.open_streams == 0 and Echo.closed == [False])


def test_stop_cancels_open_streams_after_the_grace(
    served: tuple[LoopServer, grpc.Channel],
) -> None:
    server, channel = served
    with stalled_stream(channel):
        started = time.monotonic()
        stopped = server.stop(0.3)
        assert not stopped.wait(0.1)  # the open stream keeps it running during the grace
        assert stopped.wait(30) and time.monotonic() - started >= 0.3
    assert Echo.closed == [False]


def test_a_bug_in_the_loop_is_logged_and_the_loop_goes_on(
    served: tuple[LoopServer, grpc.Channel],
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
    assert eventually(lambda: "a loop bug" in caplog.text)
    assert call(channel, b"b") == [b"b", b"bye"]
