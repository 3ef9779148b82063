"""Prompts on their way to a pod: picked, their request not ended yet (estimated-ttft's
provisional credit).

Each routed prompt is one row of its block keys, kept until its request ends. Hashes are
chained, so two prompts share a prefix only if their first blocks are equal, and the
prefix they share is then the run of equal keys from the start. Rows are grouped by their
first block, and a lookup compares the prompt with its group's rows in one kernel call
(``kernels.arriving_blocks``): picking a request costs one array write whatever the
prompt's length, ending it a dict lookup (its row by slot, length and last key), and a
lookup grows with the requests in flight that share its first block, not with the pods.
"""

from __future__ import annotations

import threading
from collections.abc import Container

import numpy as np
import numpy.typing as npt

from extproc.kernels import arriving_blocks
from extproc.pods import PodId
from extproc.prefix.hashing import Keys

MIN_ROWS = 4


class _Group:
    """The rows of the prompts that start with one block: keys (``lengths[i]`` of row
    ``i`` are its own, the rest is unused), the pod slot each was sent to, and the rows
    of each (slot, length, last key): with chained keys, a prompt sent to a slot."""

    __slots__ = ("keys", "lengths", "num_rows", "rows_of", "slots")

    def __init__(self, width: int) -> None:
        self.keys = np.empty((MIN_ROWS, width), dtype=np.int64)
        self.lengths = np.empty(MIN_ROWS, dtype=np.int64)
        self.slots = np.empty(MIN_ROWS, dtype=np.int64)
        self.num_rows = 0
        self.rows_of: dict[tuple[int, int, int], list[int]] = {}

    def append(self, keys: Keys, slot: int) -> None:
        n, length = self.num_rows, len(keys)
        capacity, width = self.keys.shape
        if n == capacity or length > width:
            self._resize(2 * capacity if n == capacity else capacity, max(width, length))
        self.keys[n, :length] = keys
        self.lengths[n] = length
        self.slots[n] = slot
        self.num_rows = n + 1
        self.rows_of.setdefault((slot, length, int(keys[-1])), []).append(n)

    def find(self, keys: Keys, slot: int) -> int | None:
        """The first row of this prompt for this slot (with chained keys, length and last
        key decide the prompt), or None."""
        rows = self.rows_of.get((slot, len(keys), int(keys[-1])))
        return min(rows) if rows else None

    def delete(self, row: int) -> None:
        """Drop ``row``; the last row takes its place."""
        last = self.num_rows - 1
        self._unlist(row)
        if row != last:
            self.keys[row] = self.keys[last]
            self.lengths[row] = self.lengths[last]
            self.slots[row] = self.slots[last]
            rows = self.rows_of[self._ident(row)]
            rows[rows.index(last)] = row
        self.num_rows = last
        capacity = len(self.lengths)
        if capacity > MIN_ROWS and last < capacity // 4:
            self._resize(capacity // 2, self.keys.shape[1])

    def keep(self, rows: npt.NDArray[np.bool_]) -> None:
        """Keep only the rows where ``rows`` (one flag per row) is true, in order."""
        n = int(rows.sum())
        self.keys[:n] = self.keys[: self.num_rows][rows]
        self.lengths[:n] = self.lengths[: self.num_rows][rows]
        self.slots[:n] = self.slots[: self.num_rows][rows]
        self.num_rows = n
        self.rows_of = {}
        for row in range(n):
            self.rows_of.setdefault(self._ident(row), []).append(row)

    def _ident(self, row: int) -> tuple[int, int, int]:
        length = int(self.lengths[row])
        return int(self.slots[row]), length, int(self.keys[row, length - 1])

    def _unlist(self, row: int) -> None:
        """Drop ``row`` from the rows of its (slot, length, last key)."""
        ident = self._ident(row)
        rows = self.rows_of[ident]
        rows.remove(row)
        if not rows:
            del self.rows_of[ident]

    def _resize(self, capacity: int, width: int) -> None:
        n = self.num_rows
        keys = np.empty((capacity, width), dtype=np.int64)
        keys[:n, : self.keys.shape[1]] = self.keys[:n]
        self.keys = keys
        self.lengths = np.resize(self.lengths, capacity)
        self.slots = np.resize(self.slots, capacity)


class Arrivals:
    """Prompts picked for a pod whose request has not ended (module doc). Thread-safe.

    Pods get small slots while they have rows (freed at none, so pods that come and go
    do not grow the tables).
    """

    def __init__(self) -> None:
        self._groups: dict[int, _Group] = {}  # first block key -> the prompts starting so
        self._slot_of: dict[PodId, int] = {}
        self._pod_of: dict[int, PodId] = {}
        self._rows_of: list[int] = []  # per slot
        self._free: list[int] = []
        # The group emptied last, for the next new one (its arrays reused): a request
        # alone with its first block makes no group and drops none.
        self._spare: _Group | None = None
        self._lock = threading.Lock()
        self._num_rows = 0

    @property
    def num_requests(self) -> int:
        """Prompts arriving now: ``add`` calls not yet undone by ``remove``."""
        return self._num_rows

    def __len__(self) -> int:
        return self._num_rows

    def add(self, keys: Keys, pod: PodId) -> None:
        """``pod`` was picked for a prompt with these (non-empty) block keys."""
        with self._lock:
            slot = self._slot_of.get(pod)
            if slot is None:
                if not self._free:
                    self._free.append(len(self._rows_of))
                    self._rows_of.append(0)
                slot = self._free.pop()
                self._slot_of[pod], self._pod_of[slot] = slot, pod
            first = int(keys[0])
            group = self._groups.get(first)
            if group is None:
                group, self._spare = self._spare or _Group(len(keys)), None
                self._groups[first] = group
            group.append(keys, slot)
            self._rows_of[slot] += 1
            self._num_rows += 1

    def remove(self, keys: Keys, pod: PodId) -> None:
        """The request ``add`` was called for ended; unknown prompts are ignored."""
        with self._lock:
            slot = self._slot_of.get(pod)
            first = int(keys[0])
            group = self._groups.get(first)
            if slot is None or group is None:
                return
            row = group.find(keys, slot)
            if row is None:
                return
            group.delete(row)
            if not group.num_rows:
                del self._groups[first]
                self._spare = group
            self._release(slot, 1)

    def match(self, keys: Keys) -> dict[PodId, int]:
        """Longest arriving prefix, in blocks, per pod with one."""
        if not self._groups:
            return {}
        with self._lock:
            group = self._groups.get(int(keys[0]))
            if group is None:
                return {}
            longest = arriving_blocks(
                group.keys, group.lengths, group.slots, group.num_rows, keys, len(self._rows_of)
            )
            pod_of = self._pod_of
            return {pod_of[slot]: blocks for slot, blocks in longest.items()}

    def forget_pods(self, keep: Container[PodId]) -> None:
        """Drop the prompts of every pod not in ``keep``."""
        with self._lock:
            gone = [slot for pod, slot in self._slot_of.items() if pod not in keep]
            if not gone:
                return
            gone_slots = np.array(gone, dtype=np.int64)
            for first, group in list(self._groups.items()):
                group.keep(~np.isin(group.slots[: group.num_rows], gone_slots))
                if not group.num_rows:
                    del self._groups[first]
            for slot in gone:
                self._release(slot, self._rows_of[slot])

    def _release(self, slot: int, num_rows: int) -> None:
        self._num_rows -= num_rows
        self._rows_of[slot] -= num_rows
        if not self._rows_of[slot]:
            del self._slot_of[self._pod_of.pop(slot)]
            self._free.append(slot)
