"""Routed requests awaiting Envoy's report of their end, bounded in size and age.

Requests whose end never arrives (extproc restarted, a log entry lost) cannot grow
memory: the oldest go first, and every dropped entry is handed to ``on_drop`` (given
at construction: the router's end of a request) so that whatever it holds (its in-flight
count) is released.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from extproc.pods import PodId
from extproc.scheduling.interfaces import Cycle

DEFAULT_MAX_PENDING = 100_000
DEFAULT_PENDING_TTL_S = 3600.0


class Pending(NamedTuple):
    """One routed request's bookkeeping until its end (a tuple: built per request, more
    cheaply than a frozen dataclass)."""

    cycle: Cycle
    pod_by_address: dict[str, PodId]
    created_s: float
    pick: PodId  # counted in flight from routing to the end, whatever pod served
    pick_tokens: int  # the pick's in-flight tokens: its uncached prompt tokens
    prefill: PodId | None
    prefill_pod_tokens: int = 0  # the prefill pod's in-flight tokens (PD)
    foreign: bool = False  # another replica's pick (``Router.apply_started``)


class PendingRecords:
    """Routed requests awaiting their completion: at most ``max_size``, none older than
    ``ttl_s`` (the oldest go first). Thread-safe."""

    def __init__(
        self,
        on_drop: Callable[[Pending], object],
        max_size: int = DEFAULT_MAX_PENDING,
        ttl_s: float = DEFAULT_PENDING_TTL_S,
    ) -> None:
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._on_drop = on_drop  # called for entries expired or pushed out, never completed
        self._items: OrderedDict[str, Pending] = OrderedDict()
        self._lock = threading.Lock()
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, request_id: str, pending: Pending) -> None:
        with self._lock:
            replaced = self._items.pop(request_id, None)
            if replaced is not None:  # the id came again before its end: drop the first
                self.num_dropped += 1
                self._on_drop(replaced)
            self._items[request_id] = pending
            self._expire(pending.created_s)

    def pop(self, request_id: str) -> Pending | None:
        with self._lock:
            return self._items.pop(request_id, None)

    def _expire(self, now_s: float) -> None:
        items = self._items
        while items and (
            len(items) > self.max_size or next(iter(items.values())).created_s < now_s - self.ttl_s
        ):
            _, dropped = items.popitem(last=False)
            self.num_dropped += 1
            self._on_drop(dropped)
