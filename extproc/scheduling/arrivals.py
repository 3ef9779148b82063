"""Prompt blocks on their way to a pod: picked, not ended yet (provisional credit).

A pick's prefill stores its prompt's blocks on the pod, but no view learns it at once:
the approximate views learn at the end of the response (``record``), the KV events after
the prefill step. Until then the pick's block keys count as held there, so a burst of
requests with a new prefix follows its first pick; the credit goes when the request ends,
however it ends. ``estimated-ttft`` keeps one over its own block keys,
``precise-prefix-cache`` one over its token-exact keys.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

from extproc.types import PodId


class Arrivals:
    """Routed requests' block keys per pod, until each ends. Thread-safe.

    ``owners[key]`` counts, per pod, the routed requests whose prompt has block ``key``.
    A lookup walks the prompt from its last block back; keys are chained, so a pod's
    first hit is its longest arriving prefix (at most one dict probe a block).
    """

    def __init__(self) -> None:
        self._owners: dict[int, Counter[PodId]] = {}
        self._lock = threading.Lock()
        self.num_requests = 0  # credited now: ``add`` calls less ``remove`` calls

    def __len__(self) -> int:
        return len(self._owners)

    def add(self, keys: Sequence[int], pod: PodId) -> None:
        with self._lock:
            self.num_requests += 1
            for key in keys:
                self._owners.setdefault(key, Counter())[pod] += 1

    def remove(self, keys: Sequence[int], pod: PodId) -> None:
        with self._lock:
            self.num_requests -= 1
            for key in keys:
                owners = self._owners.get(key)
                if owners is None or owners[pod] <= 0:
                    continue
                owners[pod] -= 1
                if owners[pod] <= 0:
                    del owners[pod]
                    if not owners:
                        del self._owners[key]

    def match(self, keys: Sequence[int]) -> dict[PodId, int]:
        """Longest arriving prefix, in blocks, per pod with one."""
        found: dict[PodId, int] = {}
        if not self._owners:
            return found
        with self._lock:
            for i in range(len(keys) - 1, -1, -1):
                owners = self._owners.get(keys[i])
                if owners:
                    for pod in owners:
                        found.setdefault(pod, i + 1)
        return found

    def forget_pods(self, keep: set[PodId]) -> None:
        with self._lock:
            for key in list(self._owners):
                owners = self._owners[key]
                for pod in [p for p in owners if p not in keep]:
                    del owners[pod]
                if not owners:
                    del self._owners[key]
