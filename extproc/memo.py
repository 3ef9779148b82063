"""``FifoMemo``: a bounded memo of a pure function's results, oldest entry out first.

For values that are costly to compute and repeat (a prompt start's block chain, a
route reply per destination list). First in, first out: a hit costs one dict lookup and
reorders nothing; a value still in use after eviction is simply computed again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class FifoMemo(Generic[K, V]):
    """At most ``size`` remembered values; safe to share between threads."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._values: dict[K, V] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def get(self, key: K, compute: Callable[[], V]) -> V:
        """The value remembered for ``key``, else ``compute()``'s, remembered."""
        value = self._values.get(key)
        if value is None:
            value = compute()
            with self._lock:
                if len(self._values) >= self.size:
                    del self._values[next(iter(self._values))]
                self._values[key] = value
        return value
