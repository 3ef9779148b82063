"""The same ``Method``s served by grpcio's public ``grpc.server``: the fallback server.

``grpc_loop.LoopServer`` drives grpcio's private ``cygrpc`` layer, which may change in
any grpcio release; when the installed grpcio lacks what it needs (``grpc_loop.
self_check``), or ``--grpc-server public`` asks for it, this server takes its place with
the same behaviour: at most ``max_streams`` streams (RESOURCE_EXHAUSTED beyond, naming
the flag), ``drain(keep=...)`` (UNAVAILABLE for the others), INTERNAL without a trace
for a handler bug, INVALID_ARGUMENT for bytes that are no message, and ``on_close
(delivered)`` for every stream opened, ``on_cancel`` when the RPC ends while the handler
waits for a Future (grpcio's termination callback; a Future then failing with
``CancelledError`` ends the stream quietly). The price is grpcio's thread pool: each open
stream holds a worker thread, and every message crosses threads (docs/performance.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Generator, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from functools import partial
from typing import Any, NoReturn

import grpc

from extproc.wire.grpc_loop import Answer, Method, Stream

log = logging.getLogger("extproc.grpc")

# Worker threads beyond max_streams, so that the streams refused past the limit get
# their answer at once instead of queueing behind held ones.
_REFUSAL_WORKERS = 8


class PublicServer:
    """Serves ``methods`` (full path -> ``Method``) on ``grpc.server``; the interface of
    ``grpc_loop.LoopServer``."""

    def __init__(
        self,
        methods: Mapping[str, Method],
        *,
        max_streams: int,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._methods = dict(methods)
        self._max_streams = max_streams
        self._open = 0
        self._lock = threading.Lock()
        self._draining: frozenset[str] | None = None
        workers = max_streams + _REFUSAL_WORKERS
        self._server = grpc.server(
            ThreadPoolExecutor(workers, thread_name_prefix="extproc-grpc"),
            handlers=self._handlers(),
            options=list(options),
            maximum_concurrent_rpcs=workers,  # a backstop: the own limit answers first
        )

    def add_insecure_port(self, address: str) -> int:
        return int(self._server.add_insecure_port(address))

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return int(self._server.add_secure_port(address, credentials))

    @property
    def open_streams(self) -> int:
        return self._open

    def start(self) -> None:
        self._server.start()

    def drain(self, keep: Collection[str]) -> None:
        """Refuse new streams (UNAVAILABLE) but those of the ``keep`` methods."""
        self._draining = frozenset(keep)

    def stop(self, grace: float | None) -> threading.Event:
        """As ``grpc.Server.stop``: the event is set once every stream has ended."""
        stopped: threading.Event = self._server.stop(grace)
        return stopped

    def _handlers(self) -> list[grpc.GenericRpcHandler]:
        """A generic handler per service (an unknown method: UNIMPLEMENTED, by grpcio);
        every method bidirectional, on bytes (parsed here, to answer as the loop does)."""
        services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        for path, method in self._methods.items():
            service, name = path.lstrip("/").split("/")
            services.setdefault(service, {})[name] = grpc.stream_stream_rpc_method_handler(
                partial(self._serve, path, method)
            )
        return [grpc.method_handlers_generic_handler(s, h) for s, h in services.items()]

    def _serve(
        self, path: str, method: Method, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        if self._draining is not None and path not in self._draining:
            _abort(context, grpc.StatusCode.UNAVAILABLE, "extproc is shutting down")
        with self._lock:
            full = self._open >= self._max_streams
            if not full:
                self._open += 1
        if full:
            _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"extproc serves at most {self._max_streams} streams at once (--max-streams)",
            )
        try:
            stream = method.open_call(context.invocation_metadata())
        except Exception:
            log.exception("cannot open a stream for %s", path)
            self._closed()
            _abort(context, grpc.StatusCode.INTERNAL, "internal error")
        outcome = _Outcome(lambda delivered: self._close(stream, delivered))
        watch = _Watch(stream)

        def terminated() -> None:
            watch.terminated()
            outcome.ended()

        if not context.add_callback(terminated):  # already over (cancelled meanwhile)
            terminated()
        try:
            yield from _exchange(method, stream, requests, context, outcome, watch)
        finally:  # also when grpcio drops the generator after a failed send
            outcome.ended()

    def _close(self, stream: Stream, delivered: bool) -> None:
        with self._lock:
            self._open -= 1
        try:
            stream.on_close(delivered)
        except Exception:
            log.exception("unexpected error closing a stream")

    def _closed(self) -> None:
        with self._lock:
            self._open -= 1


class _Outcome:
    """Closes a stream once both its RPC has terminated (grpcio's callback) and its
    handler has returned, as the loop closes one only after its last send: a stream
    cancelled while routing must not be closed before its route exists. ``delivered``:
    the last reply went out with the client still there."""

    __slots__ = ("_close", "_lock", "_pending", "delivered")

    def __init__(self, close: Callable[[bool], None]) -> None:
        self._close = close
        self._lock = threading.Lock()
        self._pending = 2
        self.delivered = False

    def ended(self) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._close(self.delivered)


class _Watch:
    """Tells a stream (``on_cancel``, once) that its RPC ended while its handler waits for
    a Future: grpcio calls ``terminated`` when the RPC ends, on its own thread."""

    __slots__ = ("_cancelled", "_lock", "_stream", "_terminated", "_waiting")

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._waiting = False
        self._terminated = False
        self._cancelled = False

    def begin(self) -> None:
        """The handler has a Future to wait for (from now: its replies first, which grpcio
        may never ask for if the RPC is over)."""
        with self._lock:
            self._waiting = True
            cancel = self._cancel_now()
        if cancel:  # the RPC was over before the wait began
            self._cancel()

    def wait(self, future: Future[Answer]) -> Answer:
        """``future``'s answer (what it raises, raised), after ``begin``."""
        try:
            return future.result()
        finally:
            with self._lock:
                self._waiting = False

    def terminated(self) -> None:
        with self._lock:
            self._terminated = True
            cancel = self._cancel_now()
        if cancel:
            self._cancel()

    def _cancel_now(self) -> bool:
        """Under the lock: whether to cancel now (once)."""
        if self._waiting and self._terminated and not self._cancelled:
            self._cancelled = True
            return True
        return False

    def _cancel(self) -> None:
        try:
            self._stream.on_cancel()
        except Exception:
            log.exception("unexpected error cancelling a stream")


def _exchange(
    method: Method,
    stream: Stream,
    requests: Iterator[bytes],
    context: grpc.ServicerContext,
    outcome: _Outcome,
    watch: _Watch,
) -> Iterator[bytes]:
    """Read messages and send each answer's replies until an answer ends the stream or
    the input ends; a failure becomes the status, as in the loop server."""
    while True:
        try:
            data = next(requests, None)
        except grpc.RpcError:  # the client went away (cancelled, deadline): nothing to send
            return
        if data is None:
            end = yield from _answer(method, stream.on_input_end, context, outcome, watch)
        else:
            try:
                message = method.parse(data)
            except Exception:  # noqa: BLE001 - whatever the parser raises, the bytes are no message
                outcome.delivered = context.is_active()
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request is not a {method.name} message",
                )
            handle = partial(stream.on_message, message)
            end = yield from _answer(method, handle, context, outcome, watch)
        if end or data is None:
            outcome.delivered = context.is_active()
            return


def _answer(
    method: Method,
    handle: Callable[[], Answer | Future[Answer]],
    context: grpc.ServicerContext,
    outcome: _Outcome,
    watch: _Watch,
) -> Generator[bytes, None, bool]:
    """Send the handler's answer (its replies now, then those of the answer it waits for)
    and return its ``end``; a bug in it aborts with INTERNAL, a cancelled wait with
    CANCELLED (quietly: the stream gave its work up, the client had left)."""
    try:
        answer = handle()
        while True:
            if isinstance(answer, Future):
                answer = Answer(later=answer)
            serialize = method.serialize
            replies = [r if type(r) is bytes else serialize(r) for r in answer.replies]
            if answer.later is not None:
                watch.begin()
            yield from replies
            if answer.later is None:
                return answer.end
            answer = watch.wait(answer.later)
    except CancelledError:
        log.debug("a stream's answer was cancelled")
        outcome.delivered = context.is_active()
        _abort(context, grpc.StatusCode.CANCELLED, "cancelled")
    except Exception:
        log.exception("unexpected error in a stream handler")
        outcome.delivered = context.is_active()
        _abort(context, grpc.StatusCode.INTERNAL, "internal error in the endpoint picker")


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """``context.abort``, typed: grpcio ships no types, and its abort always raises."""
    context.abort(code, details)
    raise AssertionError("grpc's abort returned")
