"""``RowValues``: a table pass's values read by pod id."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from extproc.pods import PodId
from extproc.scheduling.podtable import PodTable, RowValues
from testkit.factories import make_pod

NUM_PODS = 6


@given(st.lists(st.integers(0, NUM_PODS - 1), max_size=2 * NUM_PODS), st.integers(0, NUM_PODS))
def test_row_values_read_the_first_row_of_each_pod(rows: list[int], asked: int) -> None:
    """The value at the first place of the pod's row in the (ascending) positions; a pod
    not there, or not in the table, is missing."""
    table = PodTable([make_pod(f"p{i}") for i in range(NUM_PODS)])
    positions = np.array(sorted(rows), dtype=np.int64)
    values = np.arange(len(positions), dtype=np.int64) * 10 + 7
    row_values = RowValues(table, positions, values)
    pod = table.ids[asked] if asked < NUM_PODS else PodId("default", "elsewhere")
    ordered = positions.tolist()
    at = bisect_left(ordered, asked)
    expected = 10 * at + 7 if at < len(ordered) and ordered[at] == asked else None
    assert row_values.get(pod) == expected
    assert list(row_values) == [table.ids[row] for row in ordered]
