"""A gRPC server on one thread, driven straight from grpcio's completion queue.

Why not ``grpc.server``: it hands every RPC to a thread pool, and every message of it
crosses from the polling thread to a worker and back (a condition variable each way).
For extproc's short streams that hand-off was most of the cost (docs/performance.md:
CPU per routed request on this loop and on the public server). Here the thread that
polls the completion queue also runs the handlers: a stream costs three completion events (the
call, its message, the reply sent with the status), nothing waits on a lock, and an
open stream holds no thread.

This module knows gRPC, not ext_proc: a method is a ``Method`` (how to parse a message,
how to open a ``Stream``), and a stream answers each message with an ``Answer``. The
handlers run on the loop thread, so they must be quick; one that has slow work (routing
a body of megabytes, a prompt to tokenize, a request held by flow control) returns a
``Future`` of its answer instead (or an ``Answer`` whose ``later`` is one: replies now,
the rest later), computed elsewhere, and the stream reads nothing more until it is ready;
the loop serves the other streams meanwhile. The Future's completion is handed back to
the loop thread (an empty batch on the call), so a stream is only ever called there.
While a stream waits, the server watches for the client going away (a receive-close
batch) and tells the stream (``on_cancel``), which may give up the work it waits for.
grpcio's ``_cython.cygrpc`` layer is the one ``grpc.server`` and ``grpc.aio`` are built
on, but it is private: it may change in any grpcio release. ``self_check`` says whether
the installed one has what this loop uses (and serves one call through it);
``wire.server`` falls back to the public ``grpc.server`` (``grpc_public``) when it has
not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple, Protocol, TypeVar

import grpc

try:  # grpcio's own core binding (see the module docstring)
    from grpc._cython import cygrpc as _cygrpc
except ImportError:  # self_check says so; the public server is used instead
    _cygrpc = None
cygrpc: Any = _cygrpc

log = logging.getLogger("extproc.grpc")

T = TypeVar("T")
U = TypeVar("U")

# A call's invocation metadata as grpcio gives it: (key, value) pairs, keys lowercase.
Metadata = Sequence[tuple[str, str]]

_NO_FLAGS = 0
_POLL_S = 1.0  # how often the loop looks up from the queue (nothing to do otherwise)


class Answer(NamedTuple):
    """What a stream says to a message: replies to send, in order (messages, or their
    bytes serialized already); ``end``: then close the stream with OK (nothing more is
    read); ``later``: send the replies now, then wait for this answer (nothing is read
    meanwhile; ``end`` is not read, the later answer says). A Future returned by
    ``on_message`` is ``Answer(later=future)``."""

    replies: Sequence[Any] = ()
    end: bool = False
    later: Future[Answer] | None = None


class Stream(Protocol):
    """One open RPC. Called on the loop thread, one call at a time."""

    def on_message(self, message: Any) -> Answer | Future[Answer]: ...

    def on_input_end(self) -> Answer:
        """The client finished sending (or went away) before the stream ended."""
        ...

    def on_close(self, delivered: bool) -> None:
        """The stream is over; ``delivered``: its replies and status reached the client
        (False: cancelled, timed out, or failed before they did)."""
        ...

    def on_cancel(self) -> None:
        """The client went away (or the server cancelled the call) while the stream waits
        for a Future: give up the work it waits for, if it can (a Future that then fails
        with ``CancelledError`` ends the stream quietly). Called at most once, before
        ``on_close``."""
        ...


@dataclass(frozen=True, slots=True)
class Method:
    """A served method: parses each request message, opens a ``Stream`` per call."""

    parse: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]
    open: Callable[[], Stream]
    name: str  # the request message's type, for errors
    # Opens a stream given the call's metadata instead of ``open``: ext_proc's, where
    # Envoy sends its trace context (``traceparent``) when it traces.
    open_with_metadata: Callable[[Metadata], Stream] | None = None

    def open_call(self, metadata: Metadata) -> Stream:
        if self.open_with_metadata is not None:
            return self.open_with_metadata(metadata)
        return self.open()


class StopSignal:
    """What ``LoopServer.stop`` returns: ``wait(timeout)`` -> whether it stopped."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


# Work that would hold the loop up for long (tens of milliseconds and more) runs here.
_off_loop: ThreadPoolExecutor | None = None
_off_loop_lock = threading.Lock()


def run_off_loop(work: Callable[[], Answer]) -> Future[Answer]:
    """Compute a slow answer on a worker thread, for a ``Stream`` to return."""
    global _off_loop
    with _off_loop_lock:
        if _off_loop is None:
            _off_loop = ThreadPoolExecutor(2, thread_name_prefix="extproc-offloop")
    return _off_loop.submit(work)


def then(future: Future[T], finish: Callable[[Callable[[], T]], U]) -> Future[U]:
    """A Future of ``finish(future.result)``, computed by the thread that completes
    ``future``; ``finish`` gets the result by calling it (it raises what ``future`` did)."""
    out: Future[U] = Future()

    def done(result: Future[T]) -> None:
        try:
            out.set_result(finish(result.result))
        except BaseException as exc:  # noqa: BLE001 - handed on whole, as the Future holds it
            out.set_exception(exc)

    future.add_done_callback(done)
    return out


_REQUEST_CALL = object()
_SHUTDOWN = object()


class LoopServer:
    """Serves ``methods`` (full path -> ``Method``) on one thread.

    At most ``max_streams`` streams are open at once; a call beyond that is refused at
    once with RESOURCE_EXHAUSTED. An unknown method gets UNIMPLEMENTED, a message that
    does not parse INVALID_ARGUMENT, a handler that raises INTERNAL (logged here, no
    trace reaches the client).
    """

    def __init__(
        self,
        methods: Mapping[str, Method],
        *,
        max_streams: int,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._methods = {path.encode(): method for path, method in methods.items()}
        self._max_streams = max_streams
        self._queue = cygrpc.CompletionQueue()
        self._server = cygrpc.Server(tuple(options), False)
        self._server.register_completion_queue(self._queue)
        self._open: set[_Call] = set()
        self._stopped = StopSignal()
        self._stopping = False
        self._draining: frozenset[bytes] | None = None  # while draining: the methods kept
        self._cancelled_at: float | None = None
        self._lock = threading.Lock()  # start/stop against each other, not the loop
        self._thread: threading.Thread | None = None

    def add_insecure_port(self, address: str) -> int:
        return int(self._server.add_http2_port(address.encode()))

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        """As ``grpc.Server.add_secure_port``: its core credentials, which grpcio keeps
        in ``_credentials`` (``self_check`` checks that it does)."""
        return int(self._server.add_http2_port(address.encode(), credentials._credentials))

    @property
    def open_streams(self) -> int:
        return len(self._open)

    def start(self) -> None:
        with self._lock:
            self._server.start()
            self._server.request_call(self._queue, self._queue, _REQUEST_CALL)
            self._thread = threading.Thread(target=self._serve, name="extproc-grpc", daemon=True)
            self._thread.start()

    def drain(self, keep: Collection[str]) -> None:
        """From now on refuse new streams (UNAVAILABLE) but those of the ``keep`` methods;
        open streams go on. (Before ``stop``: e.g. keep taking the access logs of the
        requests still in flight.)"""
        self._draining = frozenset(path.encode() for path in keep)

    def stop(self, grace: float | None) -> StopSignal:
        """Take no new streams; after ``grace`` seconds (at once if None or 0) cancel
        those still open. The signal is set when every stream has ended."""
        with self._lock:
            if self._thread is None:
                self._stopped.set()
                return self._stopped
            if not self._stopping:
                self._stopping = True
                self._server.shutdown(self._queue, _SHUTDOWN)
                if grace:
                    timer = threading.Timer(grace, self._cancel_all)
                    timer.daemon = True
                    timer.start()
        if not grace:
            self._cancel_all()
        return self._stopped

    def _cancel_all(self) -> None:
        with self._lock:  # not after the loop destroyed the server: that would crash
            if not self._stopped.is_set():
                self._server.cancel_all_calls()
                self._cancelled_at = time.monotonic()

    def _cancelled_long_ago(self) -> bool:
        """Every stream was cancelled a while ago: one still listed is lost (a bug)."""
        return self._cancelled_at is not None and time.monotonic() - self._cancelled_at > _POLL_S

    # -- the loop ----------------------------------------------------------------------

    def _serve(self) -> None:
        queue = self._queue
        shut_down = False  # gRPC core's shutdown tag comes before open streams end
        while not (shut_down and (not self._open or self._cancelled_long_ago())):
            event = queue.poll(time.time() + _POLL_S)  # an absolute deadline
            tag = event.tag
            if tag is None:  # a poll timeout, or a batch nobody waits for
                continue
            try:
                if tag is _REQUEST_CALL:
                    self._accept(event)
                elif tag is _SHUTDOWN:
                    shut_down = True
                else:
                    tag(event)
            except Exception:  # a bug here must not end the loop (and the server with it)
                log.exception("unexpected error in the gRPC loop")
            event = None  # drop the event (and its call) before the next poll
        with self._lock:
            self._server.destroy()
            self._stopped.set()

    def _accept(self, event: Any) -> None:
        if not self._stopping:
            self._server.request_call(self._queue, self._queue, _REQUEST_CALL)
        if not event.success:
            return
        call = event.call
        method = self._methods.get(event.call_details.method)
        if method is None:
            _refuse(call, cygrpc.StatusCode.unimplemented, b"method not found")
        elif self._draining is not None and event.call_details.method not in self._draining:
            _refuse(call, cygrpc.StatusCode.unavailable, b"extproc is shutting down")
        elif len(self._open) >= self._max_streams:
            _refuse(
                call,
                cygrpc.StatusCode.resource_exhausted,
                f"extproc serves at most {self._max_streams} streams at once "
                "(--max-streams)".encode(),
            )
        else:
            try:
                stream = method.open_call(event.invocation_metadata)
            except Exception:
                log.exception("cannot open a stream for %s", event.call_details.method)
                _refuse(call, cygrpc.StatusCode.internal, b"internal error")
                return
            self._open.add(_Call(self, call, method, stream))

    def _closed(self, state: _Call) -> None:
        self._open.discard(state)


def _refuse(call: Any, code: Any, details: bytes) -> None:
    call.start_server_batch(
        (
            cygrpc.SendInitialMetadataOperation(None, _NO_FLAGS),
            cygrpc.ReceiveCloseOnServerOperation(_NO_FLAGS),
            cygrpc.SendStatusFromServerOperation(None, code, details, _NO_FLAGS),
        ),
        None,
    )


class _Call:
    """One stream's state: one receive and one send outstanding at most (gRPC's rule).

    Runs on the loop thread only: a Future's completion comes back through an empty batch.
    The receive-close batch, which says whether the call was cancelled, goes with the final
    send, or at the first wait for a Future (to notice a client leaving meanwhile); the
    stream is closed once both the final send and the close were seen.
    """

    __slots__ = (
        "_call",
        "_cancelled",
        "_close",
        "_ended",
        "_final_ok",
        "_metadata_sent",
        "_method",
        "_outbox",
        "_sending",
        "_server",
        "_status",
        "_stream",
        "_waiting",
    )

    def __init__(self, server: LoopServer, call: Any, method: Method, stream: Stream) -> None:
        self._server = server
        self._call = call
        self._method = method
        self._stream = stream
        self._outbox: deque[bytes] = deque()
        self._sending = False
        self._metadata_sent = False
        self._ended = False  # no more input is read; the status goes after the outbox
        self._status: tuple[Any, bytes] = (cygrpc.StatusCode.ok, b"")
        self._close = _CLOSE_NOT_STARTED
        self._cancelled = False  # the close was seen, cancelled
        self._waiting = False  # for a Future's answer
        self._final_ok: bool | None = None  # the final send's outcome, once seen
        self._receive()

    def _receive(self) -> None:
        self._call.start_server_batch(
            (cygrpc.ReceiveMessageOperation(_NO_FLAGS),), self._on_received
        )

    def _on_received(self, event: Any) -> None:
        if self._ended:  # input after the stream's end (or after the client left) is dropped
            return
        data = event.batch_operations[0].message() if event.success else None
        if data is None:
            self._answer(self._stream.on_input_end)
            return
        try:
            message = self._method.parse(data)
        except Exception:  # noqa: BLE001 - whatever the parser raises, the bytes are no message
            self._fail(
                cygrpc.StatusCode.invalid_argument,
                f"the request is not a {self._method.name} message".encode(),
            )
            return
        self._answer(lambda: self._stream.on_message(message))

    def _answer(self, handle: Callable[[], Answer | Future[Answer]]) -> None:
        try:
            answer = handle()
            if isinstance(answer, Future):
                answer = Answer(later=answer)
            serialize = self._method.serialize
            replies = [r if type(r) is bytes else serialize(r) for r in answer.replies]
        except CancelledError:  # the stream gave up what it waited for: the client left
            log.debug("a stream's answer was cancelled")
            self._fail(cygrpc.StatusCode.cancelled, b"cancelled")
            return
        except Exception:
            log.exception("unexpected error in a stream handler")
            self._fail(cygrpc.StatusCode.internal, b"internal error in the endpoint picker")
            return
        self._outbox.extend(replies)
        if answer.later is not None:
            self._wait(answer.later)
            return
        if answer.end:
            self._ended = True
        self._send()
        if not self._ended:
            self._receive()  # last: its completion may run on the loop thread at once

    def _wait(self, later: Future[Answer]) -> None:
        """Send what is ready, watch for the client leaving, and answer when ``later`` is
        done (on the loop thread: the thread completing it starts an empty batch)."""
        self._waiting = True
        self._send()
        if self._close == _CLOSE_NOT_STARTED:
            self._close = _CLOSE_STARTED
            self._call.start_server_batch(
                (cygrpc.ReceiveCloseOnServerOperation(_NO_FLAGS),), self._on_close
            )

        def back_on_loop(done: Future[Answer]) -> None:
            self._call.start_server_batch((), lambda _: self._answer_later(done))

        later.add_done_callback(back_on_loop)

    def _answer_later(self, done: Future[Answer]) -> None:
        self._waiting = False
        self._answer(done.result)

    def _on_close(self, event: Any) -> None:
        """The receive-close batch started by ``_wait`` completed: the call is over
        (cancelled, or its status was sent)."""
        self._close = _CLOSE_SEEN
        self._cancelled = not event.success or event.batch_operations[0].cancelled()
        if self._final_ok is not None:
            self._finish()
        elif self._cancelled and self._waiting:
            try:
                self._stream.on_cancel()
            except Exception:
                log.exception("unexpected error cancelling a stream")

    def _fail(self, code: Any, details: bytes) -> None:
        self._outbox.clear()
        self._status = (code, details)
        self._ended = True
        self._send()

    def _send(self) -> None:
        """Start the next send batch: a reply, and the status with the last one (not
        while an answer is awaited)."""
        if self._sending or not (self._outbox or (self._ended and not self._waiting)):
            return
        operations: list[Any] = []
        if not self._metadata_sent:
            operations.append(cygrpc.SendInitialMetadataOperation(None, _NO_FLAGS))
            self._metadata_sent = True
        if self._outbox:
            operations.append(cygrpc.SendMessageOperation(self._outbox.popleft(), _NO_FLAGS))
        final = self._ended and not self._outbox
        if final:
            code, details = self._status
            operations.append(cygrpc.SendStatusFromServerOperation(None, code, details, _NO_FLAGS))
            if self._close == _CLOSE_NOT_STARTED:
                self._close = _CLOSE_IN_FINAL
                operations.append(cygrpc.ReceiveCloseOnServerOperation(_NO_FLAGS))
        self._sending = True
        self._call.start_server_batch(operations, self._on_final if final else self._on_sent)

    def _on_sent(self, event: Any) -> None:
        self._sending = False
        if not event.success:  # the client is gone: nothing more can be sent
            self._outbox.clear()
            self._ended = True
        self._send()

    def _on_final(self, event: Any) -> None:
        self._final_ok = bool(event.success)
        if self._close == _CLOSE_IN_FINAL:
            self._close = _CLOSE_SEEN
            self._cancelled = event.batch_operations[-1].cancelled()
        if self._close == _CLOSE_SEEN:
            self._finish()

    def _finish(self) -> None:
        self._server._closed(self)
        try:
            self._stream.on_close(bool(self._final_ok) and not self._cancelled)
        except Exception:
            log.exception("unexpected error closing a stream")


# The receive-close batch of a call: not started, with the final send, on its own, seen.
_CLOSE_NOT_STARTED, _CLOSE_IN_FINAL, _CLOSE_STARTED, _CLOSE_SEEN = range(4)


# What the loop uses of cygrpc: its classes, the server's methods, the status codes.
_NEEDED_NAMES = (
    "CompletionQueue",
    "Server",
    "ServerCredentials",
    "StatusCode",
    "SendInitialMetadataOperation",
    "SendMessageOperation",
    "SendStatusFromServerOperation",
    "ReceiveMessageOperation",
    "ReceiveCloseOnServerOperation",
)
_NEEDED_SERVER_METHODS = (
    "register_completion_queue",
    "add_http2_port",
    "start",
    "request_call",
    "shutdown",
    "cancel_all_calls",
    "destroy",
)
_NEEDED_CODES = (
    "ok",
    "unimplemented",
    "unavailable",
    "resource_exhausted",
    "internal",
    "cancelled",
)
_SELF_CHECK_PATH = "/extproc.SelfCheck/Echo"
SELF_CHECK_TIMEOUT_S = 5.0


class _SelfCheckEcho:
    """Echoes each message, as an answer that comes later (what a held request takes: the
    receive-close batch and the empty batch back to the loop), ends when the input ends."""

    def on_message(self, message: bytes) -> Answer:
        echo: Future[Answer] = Future()
        echo.set_result(Answer((message,)))
        return Answer(later=echo)

    def on_input_end(self) -> Answer:
        return Answer((b"end",), end=True)

    def on_close(self, delivered: bool) -> None:
        pass

    def on_cancel(self) -> None:
        pass


@cache
def self_check() -> str | None:
    """Why the installed grpcio cannot carry the loop server, or None when it can: the
    cygrpc names it uses exist, the credentials wrapper holds core credentials, and one
    echo call goes through a loop server on 127.0.0.1 (a few milliseconds, once)."""
    if cygrpc is None:
        return "grpcio has no grpc._cython.cygrpc"
    missing = [n for n in _NEEDED_NAMES if not hasattr(cygrpc, n)]
    missing += [f"Server.{n}" for n in _NEEDED_SERVER_METHODS if not hasattr(cygrpc.Server, n)]
    if hasattr(cygrpc, "StatusCode"):
        missing += [f"StatusCode.{c}" for c in _NEEDED_CODES if not hasattr(cygrpc.StatusCode, c)]
    if missing:
        return f"grpcio {grpc.__version__}'s cygrpc lacks {', '.join(missing)}"
    credentials = grpc.local_server_credentials()
    if not isinstance(getattr(credentials, "_credentials", None), cygrpc.ServerCredentials):
        return f"grpcio {grpc.__version__}'s ServerCredentials no longer wrap cygrpc's"
    try:
        return _echo_once()
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use the loop
        return f"the loop server failed its self-check on grpcio {grpc.__version__}: {exc!r}"


def _echo_once() -> str | None:
    server = LoopServer(
        {_SELF_CHECK_PATH: Method(bytes, bytes, _SelfCheckEcho, "bytes")},
        max_streams=1,
        options=[("grpc.so_reuseport", 0)],
    )
    port = server.add_insecure_port("127.0.0.1:0")
    if not port:
        return "the loop server's self-check could not bind 127.0.0.1"
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            replies = list(
                channel.stream_stream(_SELF_CHECK_PATH)(
                    iter([b"ping"]), timeout=SELF_CHECK_TIMEOUT_S
                )
            )
    finally:
        stopped = server.stop(0).wait(SELF_CHECK_TIMEOUT_S)
    if replies != [b"ping", b"end"]:
        return f"the loop server's self-check echoed {replies!r}"
    if not stopped:
        return "the loop server did not stop in its self-check"
    return None
