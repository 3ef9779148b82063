"""The router's preparing threads: a request's slow preparation (``scheduling.interfaces.
Preparer``: precise-prefix-cache encoding a prompt's new segments) runs here, not on
the thread that serves every other request (the gRPC loop).

A small pool: ``tokenizers`` releases the GIL while it encodes, so a few threads use the
other cores. At most ``max_waiting`` requests wait or run here at once; beyond that
``submit`` refuses, and the router schedules the request without the work (precise-
prefix-cache scores it from its approximate view, counted as ``busy``). ``close`` (the
drain) takes nothing more, routes the waiting requests at once without their work and
waits for the running ones, so that every request submitted gets its answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_THREADS = 2
# A full queue of cold long prompts behind DEFAULT_THREADS threads is still answered well
# inside Envoy's message_timeout, with room for a loaded machine (the tokenizing cost:
# bench/results/figures-from-code.md); past that an approximate route at once beats a
# late exact one.
DEFAULT_MAX_WAITING = 32


class PreparePool:
    """Runs work off the caller's thread, refusing it when ``max_waiting`` are in."""

    def __init__(
        self, num_threads: int = DEFAULT_THREADS, max_waiting: int = DEFAULT_MAX_WAITING
    ) -> None:
        if num_threads < 1 or max_waiting < 1:
            raise ValueError(
                f"a prepare pool needs a thread and a place, got {num_threads}, {max_waiting}"
            )
        self.num_threads = num_threads
        self.max_waiting = max_waiting
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="extproc-prepare")
        self._waiting: dict[Future[Any], Callable[[bool], Any]] = {}  # not started yet
        self._num_running = 0
        self._closing = False
        self._changed = threading.Condition()

    @property
    def num_in(self) -> int:
        """Work waiting or running."""
        return len(self._waiting) + self._num_running

    def submit(self, work: Callable[[bool], T]) -> Future[T] | None:
        """A Future of ``work(True)`` run on a pool thread (``work(False)`` when the pool
        closes before it started: do without the slow part); None, and nothing run, when
        ``max_waiting`` are in already or the pool is closed."""
        with self._changed:
            if self._closing or self.num_in >= self.max_waiting:
                return None
            future: Future[T] = Future()
            self._waiting[future] = work
            self._executor.submit(self._start, future)
            return future

    def _start(self, future: Future[Any]) -> None:
        with self._changed:
            work = self._waiting.pop(future, None)
            if work is None:  # ``close`` ran it
                return
            self._num_running += 1
        try:
            _resolve(future, work, True)
        finally:
            with self._changed:
                self._num_running -= 1
                self._changed.notify_all()

    def close(self, timeout_s: float) -> bool:
        """Refuse new work, run what waits without its slow part (here, now), and wait up
        to ``timeout_s`` for the running work to finish; returns whether it did."""
        with self._changed:
            self._closing = True
            waiting, self._waiting = self._waiting, {}
        for future, work in waiting.items():
            _resolve(future, work, False)
        with self._changed:
            done = self._changed.wait_for(lambda: self._num_running == 0, timeout_s)
        self._executor.shutdown(wait=False)
        return done


def _resolve(future: Future[T], work: Callable[[bool], T], prepare: bool) -> None:
    try:
        future.set_result(work(prepare))
    except BaseException as exc:  # noqa: BLE001 - handed on whole, as the Future holds it
        future.set_exception(exc)
