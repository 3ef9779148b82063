"""The held requests of one model: bands by priority, fair queueing within a band.

Between bands the order is strict: a band is served only when every higher one is
empty. Within a band, requests are grouped into flows by fairness key and served by
self-clocked fair queueing over tokens: each request gets a finish tag, the band's
virtual time (the tag of the request it last served) or its flow's last tag, whichever
is later, plus its estimated tokens; the lowest tag goes first. Backlogged flows get
equal shares of tokens (what deficit round robin over tokens converges to), a flow that
was idle does not bank credit for its silence, and the order is exact without a
quantum to tune. Each band is a heap: push and pop cost O(log n).

Not thread-safe: ``FlowController`` holds its lock around every call.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from extproc.routing.flow.held import Held

_sequence = itertools.count()


@dataclass(eq=False, slots=True)
class Entry:
    """One held request."""

    held: Held
    model: str
    priority: int
    fairness_key: str
    cost: int  # estimated tokens: what fairness shares
    size: int  # body bytes: what the queue's byte limit counts
    enqueued: float  # time.monotonic()
    route: Callable[[], Any]  # routes the request when it is dispatched
    seq: int = field(default_factory=lambda: next(_sequence))
    queued: bool = True  # False once dispatched, refused or cancelled


class _Band:
    """One priority's requests, in fair-queueing order."""

    __slots__ = ("_heap", "_last_tag", "_virtual", "count", "size")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Entry]] = []
        self._last_tag: dict[str, float] = {}
        self._virtual = 0.0
        self.count = 0
        self.size = 0

    def push(self, entry: Entry) -> None:
        start = max(self._virtual, self._last_tag.get(entry.fairness_key, 0.0))
        tag = start + max(1, entry.cost)
        self._last_tag[entry.fairness_key] = tag
        heapq.heappush(self._heap, (tag, entry.seq, entry))
        self.count += 1
        self.size += entry.size

    def pop(self) -> Entry | None:
        while self._heap:
            tag, _, entry = heapq.heappop(self._heap)
            if entry.queued:
                self._virtual = tag
                self._taken(entry)
                return entry
        return None

    def discard(self, entry: Entry) -> None:
        """``entry`` leaves otherwise (refused, cancelled): its heap slot is skipped."""
        self._taken(entry)

    def newest(self) -> Entry | None:
        live = [e for _, _, e in self._heap if e.queued]
        return max(live, key=lambda e: e.seq) if live else None

    def _taken(self, entry: Entry) -> None:
        entry.queued = False
        self.count -= 1
        self.size -= entry.size
        if not self.count:  # every flow is idle: their tags say nothing any more
            self._heap.clear()
            self._last_tag.clear()
            self._virtual = 0.0


class ModelQueue:
    """A model's bands, highest priority first."""

    def __init__(self) -> None:
        self._bands: dict[int, _Band] = {}
        self._order: list[int] = []  # priorities, highest first
        self.count = 0

    def push(self, entry: Entry) -> None:
        band = self._bands.get(entry.priority)
        if band is None:
            band = self._bands[entry.priority] = _Band()
            self._order = sorted(self._bands, reverse=True)
        band.push(entry)
        self.count += 1

    def best_priority(self) -> int | None:
        """The priority of the best band holding a request."""
        for priority in self._order:
            if self._bands[priority].count:
                return priority
        return None

    def pop(self) -> Entry | None:
        """The next request to dispatch: the best band's lowest tag."""
        for priority in self._order:
            band = self._bands[priority]
            if band.count:
                entry = band.pop()
                if entry is not None:
                    self.count -= 1
                    return entry
        return None

    def discard(self, entry: Entry) -> None:
        if entry.queued:
            self._bands[entry.priority].discard(entry)
            self.count -= 1

    def lowest(self) -> Entry | None:
        """The newest request of the lowest non-empty band: the first to evict."""
        for priority in reversed(self._order):
            band = self._bands[priority]
            if band.count:
                return band.newest()
        return None

    def bands(self) -> Iterator[tuple[int, int, int]]:
        """(priority, requests, bytes) of each band that has held a request."""
        for priority in self._order:
            band = self._bands[priority]
            yield priority, band.count, band.size
