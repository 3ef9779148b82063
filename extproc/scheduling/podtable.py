"""One pod snapshot as NumPy columns, built once and shared by every request.

The scheduler scores a request against every candidate pod. Walking ``Pod`` objects in
Python for each request costs a Python step per pod and plugin; a ``PodTable``
holds the same snapshot as arrays (one row per pod, in snapshot order), so filters and
scorers work on whole columns and a request costs a few dozen NumPy calls whatever the
number of pods.

Rows are addressed by position (``Positions``: an int64 array of row numbers, ascending
in the scheduler's own passes). A snapshot is immutable (a tuple of frozen pods), so its
table never goes stale: a new snapshot gets a new table (``Scheduler.pods_changed`` builds
it as the snapshot is published, so no request pays for it).

Columns follow ``PodMetrics``; a latency without data is ``has_ttft``/``has_itl`` False.
Scraped values are finite (``engine_metrics`` clamps them); a non-finite one in a
hand-built pod is read as no data (latency) or as fully used (``kv_usage``).
``memo`` keeps, for plugins, what is the same for every request of the snapshot (the
gpu-usage and least-latency scores). With ``rows_only`` the value depends only on which
pod is in which row (prefix-cache's candidate set, which pods serve a model), and it is
kept as long as later snapshots list the same pods (ids and models) in the same order (a
table built with ``previous`` shares its predecessor's ``ids``, ``position`` and that
memory): scrapes change metrics every
interval, the pods themselves seldom. Keys are the plugin's choice (the plugin and the
candidates' bytes); each memory is cleared when it grows past ``MAX_SCRATCH`` entries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import attrgetter, contains
from typing import Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from extproc.errors import ModelNotFound, NoReadyPods
from extproc.pods import Pod, PodId, PodRole

T = TypeVar("T")
G = TypeVar("G", bound=np.generic)
Positions = npt.NDArray[np.int64]
MAX_SCRATCH = 64  # entries of per-snapshot plugin memory before it is cleared


class Candidates(NamedTuple):
    """Ready pods serving one model, as positions."""

    all: Positions
    serving: Positions  # decode and ordinary pods
    prefill: Positions


class PodTable:
    """A pod snapshot as columns; see the module docstring."""

    __slots__ = (
        "_by_model",
        "_models",
        "_models_by_row",
        "by_rows",
        "every_row",
        "has_itl",
        "has_ttft",
        "ids",
        "is_prefill",
        "itl_s",
        "kv_usage",
        "objects",
        "pods",
        "position",
        "ready",
        "running",
        "scratch",
        "ttft_s",
        "waiting",
    )

    def __init__(self, pods: Sequence[Pod], previous: PodTable | None = None) -> None:
        self.pods: tuple[Pod, ...] = tuple(pods)
        n = len(self.pods)
        self.objects: npt.NDArray[np.object_] = np.fromiter(self.pods, dtype=object, count=n)
        # The candidates when every pod is one (``candidates``); ``rows`` knows it by identity.
        self.every_row: Positions = np.arange(n, dtype=np.int64)
        self.ids: tuple[PodId, ...] = tuple(map(attrgetter("id"), self.pods))
        self._models_by_row = tuple(map(attrgetter("models"), self.pods))
        self.position: dict[PodId, int]
        self.by_rows: dict[Any, Any]
        self._models: frozenset[str]
        if (
            previous is not None
            and previous.ids == self.ids
            and previous._models_by_row == self._models_by_row
        ):  # the same pods in the same order: share what depends on that alone
            self.ids, self._models_by_row = previous.ids, previous._models_by_row
            self.position, self.by_rows = previous.position, previous.by_rows
            self._models = previous._models
        else:
            # a duplicate id maps to its first row (the last write wins, rows reversed)
            self.position = dict(zip(reversed(self.ids), range(n - 1, -1, -1)))
            self.by_rows = {}
            self._models = frozenset().union(*self._models_by_row)
        metrics = list(map(attrgetter("metrics"), self.pods))
        self.waiting = np.fromiter(map(attrgetter("waiting"), metrics), np.int64, n)
        self.running = np.fromiter(map(attrgetter("running"), metrics), np.int64, n)
        kv = np.fromiter(map(attrgetter("kv_usage"), metrics), np.float64, n)
        self.kv_usage = np.where(np.isfinite(kv), kv, 1.0)
        self.ttft_s, self.has_ttft = _latency(list(map(attrgetter("ttft_s"), metrics)))
        self.itl_s, self.has_itl = _latency(list(map(attrgetter("itl_s"), metrics)))
        self.ready = np.fromiter(map(attrgetter("ready"), self.pods), np.bool_, n)
        roles = map(attrgetter("role"), self.pods)
        self.is_prefill = np.fromiter(map(PodRole.PREFILL.__eq__, roles), np.bool_, n)
        self.scratch: dict[Any, Any] = {}
        self._by_model: dict[str, Candidates] = {}

    def __len__(self) -> int:
        return len(self.pods)

    def all_positions(self) -> Positions:
        return np.arange(len(self.pods), dtype=np.int64)

    def take(self, positions: Positions) -> list[Pod]:
        """The pods at ``positions``, in that order."""
        pods: list[Pod] = self.objects[positions].tolist()
        return pods

    def rows(self, column: npt.NDArray[G], positions: Positions) -> npt.NDArray[G]:
        """``column[positions]`` for a column of this table: a plain copy when the
        positions are ``every_row`` (no pod left out, the usual candidates), which costs
        a small part of a gather over many pods."""
        if positions is self.every_row:
            return column.copy()
        return column[positions]

    def candidates(self, model: str) -> Candidates:
        """Ready pods serving ``model``, computed once per model.

        Raises:
            ModelNotFound: no pod serves the model.
            NoReadyPods: pods serve the model but none is ready.
        """
        found = self._by_model.get(model)
        if found is not None:
            return found
        if model not in self._models:
            raise ModelNotFound(f"the model {model!r} does not exist: no pod serves it")
        serves = self.serves(model)
        ready = serves & self.ready
        if not ready.any():
            raise NoReadyPods(
                f"no pod serving model {model!r} is ready ({int(serves.sum())} known, none ready)"
            )
        every = ready.all()
        no_prefill = not self.is_prefill.any()
        found = Candidates(
            self.every_row if every else np.flatnonzero(ready),
            self.every_row if every and no_prefill else np.flatnonzero(ready & ~self.is_prefill),
            np.flatnonzero(ready & self.is_prefill),
        )
        self._by_model[model] = found  # bounded: only models some pod serves
        return found

    def serves(self, model: str) -> npt.NDArray[np.bool_]:
        """Per row, whether the pod's model set holds ``model`` (ready or not), computed
        once while the snapshots list the same pods."""
        return self.memo(("serves", model), lambda: self._serves(model), rows_only=True)

    def _serves(self, model: str) -> npt.NDArray[np.bool_]:
        serves = map(contains, self._models_by_row, repeat(model))
        return np.fromiter(serves, np.bool_, len(self.pods))

    def memo(self, key: Any, compute: Callable[[], T], *, rows_only: bool = False) -> T:
        """``compute()``, kept under ``key`` for the snapshot's life, or with ``rows_only``
        for as long as snapshots list the same pods in the same order (module doc)."""
        memory = self.by_rows if rows_only else self.scratch
        try:
            value: T = memory[key]
        except KeyError:
            value = compute()
            if len(memory) >= MAX_SCRATCH:
                memory.clear()
            memory[key] = value
        return value


class RowValues(Mapping[PodId, int]):
    """One int per row of ``positions`` (ascending) of a table, read by pod id: what a
    table pass leaves for every candidate, without a dict built for each."""

    __slots__ = ("_positions", "_table", "_values")

    def __init__(self, table: PodTable, positions: Positions, values: npt.NDArray[np.int64]):
        self._table, self._positions, self._values = table, positions, values

    def __getitem__(self, pod: PodId) -> int:
        row = self._table.position.get(pod)
        if row is not None:
            positions = self._positions  # methods and item(): no NumPy scalar, no dispatch
            at = int(positions.searchsorted(row))
            if at < len(positions) and positions.item(at) == row:
                return int(self._values.item(at))
        raise KeyError(pod)

    def __iter__(self) -> Iterator[PodId]:
        return map(self._table.ids.__getitem__, self._positions.tolist())

    def __len__(self) -> int:
        return len(self._positions)


def _latency(
    values: list[float | None],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """The values (None as NaN), and which are known: not None and finite."""
    column = np.array(values, dtype=np.float64).reshape(len(values))  # None -> NaN
    known = np.isfinite(column)
    column[~known] = 0.0
    return column, known
