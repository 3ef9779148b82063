"""A request flow control holds: a Future of its route, with the time it may wait."""

from __future__ import annotations

import time
from concurrent.futures import Future

from extproc.routing.decision import RouteDecision


class Held(Future[RouteDecision]):
    """The route of a queued request: set when the request is dispatched, or the
    ``Overloaded`` error when it is refused (its time to live ended, it was evicted, or
    the queue was full). ``cancel()`` takes it out of the queue (the client went away).

    ``deadline`` is on ``time.monotonic()``: the wire layer keeps Envoy waiting at least
    until then (``hold_s``).
    """

    def __init__(self, deadline: float, priority: int) -> None:
        super().__init__()
        self.deadline = deadline
        self.priority = priority

    def hold_s(self) -> float:
        """Seconds left before the request's time to live ends (0 if it has)."""
        return max(0.0, self.deadline - time.monotonic())
