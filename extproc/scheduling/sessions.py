"""Session sticky: a session key bound to the pod (or prefill/decode pair) that served it.

A request carrying a session key (from the configured header) whose bound pod still
passes the filters goes to that pod without scoring; otherwise it is scored as usual, and
the pod that serves it successfully becomes the new binding. Bindings expire ``ttl_s``
after their last use (sliding), and at most ``max_sessions`` are kept (least recently
used dropped first), so memory stays bounded whatever clients send.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from extproc.pods import PodId


@dataclass(frozen=True, slots=True)
class Binding:
    pod: PodId  # the decode (or ordinary) pod
    prefill: PodId | None = None  # with prefill/decode disaggregation


class SessionStore:
    """Thread-safe bounded map: session key -> ``Binding``, with a sliding TTL."""

    def __init__(
        self,
        ttl_s: float = 600.0,
        max_sessions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0 or max_sessions <= 0:
            raise ValueError(f"ttl_s and max_sessions must be > 0, got {ttl_s}, {max_sessions}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._items: OrderedDict[str, tuple[Binding, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> Binding | None:
        """The live binding of ``key`` (its TTL restarts), or None."""
        now = self._clock()
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            binding, expires = item
            if expires <= now:
                del self._items[key]
                return None
            self._items[key] = (binding, now + self.ttl_s)
            self._items.move_to_end(key)
            return binding

    def bind(self, key: str, binding: Binding) -> None:
        now = self._clock()
        with self._lock:
            self._items[key] = (binding, now + self.ttl_s)
            self._items.move_to_end(key)
            while len(self._items) > self.max_sessions:
                self._items.popitem(last=False)
            # drop expired ones from the old end, a few at a time (amortised)
            for _ in range(4):
                oldest = next(iter(self._items.values()), None)
                if oldest is None or oldest[1] > now:
                    break
                self._items.popitem(last=False)

    def forget_pods(self, live: set[PodId]) -> None:
        """Drop bindings to pods that no longer exist."""
        with self._lock:
            gone = [
                k
                for k, (b, _) in self._items.items()
                if b.pod not in live or (b.prefill is not None and b.prefill not in live)
            ]
            for k in gone:
                del self._items[k]
