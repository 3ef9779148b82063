"""A recorded prefix view (``PrefixIndex``) matched against a pod table's rows.

What the plugins with a prefix view share on their table path (prefix-cache,
estimated-ttft): the candidates in the form the index matches fastest, and the matches
as one value per candidate row.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import repeat
from typing import Any

import numpy as np
import numpy.typing as npt

from extproc.pods import PodId
from extproc.prefix.hashing import Keys
from extproc.prefix.index import PodSet, PrefixIndex
from extproc.scheduling.podtable import PodTable, Positions

MAX_EXCLUDED = 64  # candidates matched as "every pod but these" up to this many left out
FEW_VALUES = 4  # values up to which ``per_row`` places them one by one (beyond: in arrays)


def match_rows(
    index: PrefixIndex, keys: Keys, table: PodTable, positions: Positions, top_k: int
) -> dict[PodId, int]:
    """``index.match`` over the pods at ``positions`` (ascending), up to ``top_k``."""
    pod_set, exclude, _ = _candidates(index, table, positions)
    return index.match(keys, pod_set, top_k, exclude)


def match_lengths(
    index: PrefixIndex, keys: Keys, table: PodTable, positions: Positions
) -> npt.NDArray[np.int64]:
    """``index.match_lengths`` over the pods at ``positions`` (ascending): every
    candidate's longest recorded match, in blocks, one per row of ``positions``."""
    pod_set, exclude, every_pod = _candidates(index, table, positions)
    lengths = index.match_lengths(keys, pod_set, exclude)
    return table.rows(lengths, positions) if every_pod else lengths


def _candidates(
    index: PrefixIndex, table: PodTable, positions: Positions
) -> tuple[PodSet, list[PodId], bool]:
    """The candidates as the index matches them fastest, and whether the set is every pod
    of the table (in row order; less ``exclude``) or exactly the rows of ``positions``.

    The candidates' slot masks are kept while the snapshots list the same pods
    (``PodSet``, in the table's ``rows_only`` memory): every pod's, less the few rows left
    out (the filters change with each snapshot's metrics), else those of exactly these rows.
    """
    num_excluded = len(table) - len(positions)
    exclude: list[PodId] = []
    if num_excluded <= max(MAX_EXCLUDED, len(positions) // 8):
        pod_set = table.memo((index, "all"), lambda: PodSet(table.ids), rows_only=True)
        if num_excluded:
            excluded = np.ones(len(table), dtype=np.bool_)
            excluded[positions] = False
            exclude = [table.ids[row] for row in np.flatnonzero(excluded).tolist()]
        return pod_set, exclude, True
    pod_set = table.memo(
        (index, positions.tobytes()),
        lambda: PodSet(table.ids[i] for i in positions.tolist()),
        rows_only=True,
    )
    return pod_set, exclude, False


def per_row(
    table: PodTable,
    positions: Positions,
    values: Mapping[PodId, float],
    dtype: type[np.int64 | np.float64] = np.int64,
) -> npt.NDArray[Any]:
    """``values`` as one number per row of ``positions`` (ascending); 0 for the rows of pods
    without a value. Pods that are not at ``positions`` are ignored."""
    out = np.zeros(len(positions), dtype=dtype)
    if not values or not len(positions):
        return out
    if len(values) <= FEW_VALUES:
        for pod, value in values.items():
            row = table.position.get(pod)
            if row is not None:
                place = int(positions.searchsorted(row))
                if place < len(positions) and positions.item(place) == row:
                    out[place] = value
        return out
    rows = np.fromiter(map(table.position.get, values, repeat(-1)), np.int64, len(values))
    at = np.minimum(np.searchsorted(positions, rows), len(positions) - 1)
    found = positions[at] == rows
    out[at[found]] = np.fromiter(values.values(), dtype, len(values))[found]
    return out
