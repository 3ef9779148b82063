"""Requests this router sent to each pod that have not ended yet.

Scraped queue lengths lag by up to a scrape interval plus the time a request takes to
reach the engine; these counters change the moment a decision is made, so a burst
routed between two scrapes still spreads. The router calls ``start`` for the chosen pod
when it routes and ``end`` (same pod, same token count) when Envoy reports the request
ended, whatever the outcome and whichever pod finally served it.

Each request also carries an estimate of the prompt tokens the pod has to prefill for
it (``Cycle.num_prefill_tokens``); ``cost-aware`` uses the per-pod total to size the
work queued ahead of a new request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from extproc.pods import PodId

log = logging.getLogger("extproc.scheduling")


class InFlightCount(NamedTuple):
    num_requests: int
    num_tokens: int  # sum of the requests' estimated prefill tokens


_ZERO = InFlightCount(0, 0)
_Column = npt.NDArray[np.int64]


class InFlight:
    """Per-pod counters of routed, unfinished requests. Thread-safe.

    Writers serialise on a lock; readers get the pod's current immutable count from a
    dict without locking (a single dict lookup is atomic). Pods whose count returns to
    zero are dropped, so the map holds only pods with requests in flight.

    The counts are also kept per row of the latest pod table read (``counts_at``), kept
    up to date by ``start`` and ``end``: a read copies two arrays, with no step per pod.
    """

    def __init__(self) -> None:
        self._counts: dict[PodId, InFlightCount] = {}
        # a table's pod -> row, its number of rows, and requests and tokens per row
        self._rows: tuple[Mapping[PodId, int], int, _Column, _Column] | None = None
        self._lock = threading.Lock()

    def start(self, pod_id: PodId, num_tokens: int = 0) -> None:
        """A request was routed to ``pod_id``; ``num_tokens`` is its prefill estimate."""
        with self._lock:
            n, tokens = self._counts.get(pod_id, _ZERO)
            self._counts[pod_id] = count = InFlightCount(n + 1, tokens + num_tokens)
            self._set_row(pod_id, count)

    def end(self, pod_id: PodId, num_tokens: int = 0) -> None:
        """The request started with ``start(pod_id, num_tokens)`` ended.

        An ``end`` without its ``start`` (a bug in the caller) is logged and ignored,
        so counts never go negative.
        """
        with self._lock:
            n, tokens = self._counts.get(pod_id, _ZERO)
            if n <= 0:
                log.warning("in-flight end for %s without a matching start", pod_id)
                return
            if n == 1:
                del self._counts[pod_id]
                self._set_row(pod_id, _ZERO)
            else:
                count = InFlightCount(n - 1, max(0, tokens - num_tokens))
                self._counts[pod_id] = count
                self._set_row(pod_id, count)

    def _set_row(self, pod_id: PodId, count: InFlightCount) -> None:
        """``count`` into the rows kept for ``counts_at``, if the pod has one there."""
        if self._rows is not None:
            rows, num_rows, requests, tokens = self._rows
            row = rows.get(pod_id)
            if row is not None and row < num_rows:
                requests[row], tokens[row] = count

    def get(self, pod_id: PodId) -> int:
        """Requests in flight to ``pod_id``."""
        return self._counts.get(pod_id, _ZERO).num_requests

    def get_count(self, pod_id: PodId) -> InFlightCount:
        """Requests and their prefill tokens in flight to ``pod_id``."""
        return self._counts.get(pod_id, _ZERO)

    def snapshot(self) -> dict[PodId, InFlightCount]:
        """A consistent copy of every non-zero count."""
        with self._lock:
            return dict(self._counts)

    def requests_at(self, rows: Mapping[PodId, int], num_rows: int) -> npt.NDArray[np.int64]:
        """Requests in flight per row of a pod table (``rows``: pod -> row; others 0).

        Costs an array copy while the same ``rows`` come back (a table's pods do not
        change), else one step per pod with requests in flight; none per idle pod.
        """
        with self._lock:
            return self._kept_rows(rows, num_rows)[2].copy()

    def counts_at(
        self, rows: Mapping[PodId, int], num_rows: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Requests in flight and their prefill tokens per row of a pod table, as
        ``requests_at``."""
        with self._lock:
            kept = self._kept_rows(rows, num_rows)
            return kept[2].copy(), kept[3].copy()

    def _kept_rows(
        self, rows: Mapping[PodId, int], num_rows: int
    ) -> tuple[Mapping[PodId, int], int, _Column, _Column]:
        """The counts kept per row of the table of ``rows``, made now if another table's
        were kept (the caller holds the lock)."""
        kept = self._rows
        if kept is None or kept[0] is not rows or kept[1] != num_rows:
            requests = np.zeros(num_rows, dtype=np.int64)
            tokens = np.zeros(num_rows, dtype=np.int64)
            for pod_id, count in self._counts.items():
                row = rows.get(pod_id)
                if row is not None:
                    requests[row], tokens[row] = count
            kept = self._rows = (rows, num_rows, requests, tokens)
        return kept
