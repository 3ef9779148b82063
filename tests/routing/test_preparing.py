"""The router's preparing pool: bounded, and a close that answers every request in it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from extproc.routing.preparing import PreparePool


class Held:
    """Work that says when it starts and finishes when released: ``(prepare, thread)``."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, prepare: bool) -> tuple[bool, str]:
        self.started.set()
        if prepare:
            assert self.release.wait(10)
        return prepare, threading.current_thread().name


@pytest.fixture
def pool() -> Iterator[PreparePool]:
    pool = PreparePool(num_threads=1, max_waiting=2)
    yield pool
    pool.close(5)


def test_work_beyond_the_bound_is_refused_until_some_finishes(pool: PreparePool) -> None:
    first, second = Held(), Held()
    running = pool.submit(first)
    waiting = pool.submit(second)
    assert running is not None and waiting is not None
    assert first.started.wait(5)
    assert pool.num_in == 2
    assert pool.submit(Held()) is None  # full: nothing run
    first.release.set()
    second.release.set()
    assert running.result(5)[0] is True and waiting.result(5)[0] is True
    assert running.result()[1].startswith("extproc-prepare")
    assert pool.num_in == 0
    again = pool.submit(lambda prepare: prepare)
    assert again is not None and again.result(5) is True


def test_close_runs_what_waits_without_preparing_and_waits_for_what_runs(
    pool: PreparePool,
) -> None:
    first, second = Held(), Held()
    running, waiting = pool.submit(first), pool.submit(second)
    assert running is not None and waiting is not None
    assert first.started.wait(5)
    closed = threading.Thread(target=pool.close, args=(10,))
    closed.start()
    # The waiting work runs at once, on the closing thread, told not to prepare.
    assert waiting.result(5) == (False, closed.name)
    assert not running.done() and closed.is_alive()
    first.release.set()
    closed.join(5)
    assert not closed.is_alive()
    assert running.result(5)[0] is True
    assert pool.submit(Held()) is None  # closed


def test_close_says_when_running_work_outlasts_it(pool: PreparePool) -> None:
    stuck = Held()
    running = pool.submit(stuck)
    assert running is not None and stuck.started.wait(5)
    assert pool.close(0.05) is False
    stuck.release.set()
    assert running.result(5)[0] is True


def test_an_error_in_the_work_is_the_futures(pool: PreparePool) -> None:
    future = pool.submit(lambda prepare: 1 / 0)
    assert future is not None
    with pytest.raises(ZeroDivisionError):
        future.result(5)
    assert pool.num_in == 0


def test_a_pool_needs_a_thread_and_a_place() -> None:
    with pytest.raises(ValueError, match="needs a thread and a place"):
        PreparePool(num_threads=0)
    with pytest.raises(ValueError, match="needs a thread and a place"):
        PreparePool(max_waiting=0)
