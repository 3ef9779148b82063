"""Polling a condition until it holds: the tests', e2e's and benchmarks' one wait loop."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object],
    timeout_s: float = 5.0,
    *,
    interval_s: float = 0.02,
    what: str | Callable[[], object] | None = None,
) -> None:
    """Call ``condition`` every ``interval_s`` until it returns something true; an
    ``OSError`` (a process starting, restarting or draining) counts as not yet.

    At ``timeout_s`` raise an ``AssertionError`` naming what was awaited: ``what`` (a
    callable is called then, to report the state at the deadline) or else the condition's
    source, with the last ``OSError`` if any.
    """
    deadline = time.monotonic() + timeout_s
    error: OSError | None = None
    while True:
        try:
            if condition():
                return
        except OSError as e:
            error = e
        if time.monotonic() > deadline:
            awaited = what() if callable(what) else what or _source(condition)
            cause = f" (last error: {error!r})" if error else ""
            raise AssertionError(f"not within {timeout_s} s: {awaited}{cause}")
        time.sleep(interval_s)


def _source(condition: Callable[[], object]) -> str:
    """A lambda's source line, else the function's name."""
    name = getattr(condition, "__qualname__", repr(condition))
    if not name.endswith("<lambda>"):
        return name
    try:
        return " ".join(inspect.getsource(condition).split())
    except (OSError, TypeError):
        return name
