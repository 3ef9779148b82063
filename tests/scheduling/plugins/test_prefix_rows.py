"""``per_row``: values by pod as one number per candidate row."""

from __future__ import annotations

from bisect import bisect_left
from unittest import mock

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from extproc.pods import PodId
from extproc.scheduling.plugins import prefix_rows
from extproc.scheduling.podtable import PodTable
from testkit.factories import make_pod

NUM_PODS = 8
TABLE = PodTable([make_pod(f"p{i}") for i in range(NUM_PODS)])
ELSEWHERE = PodId("default", "elsewhere")


@given(
    st.lists(st.integers(0, NUM_PODS - 1), max_size=2 * NUM_PODS),
    st.dictionaries(
        st.sampled_from([*TABLE.ids, ELSEWHERE]), st.integers(1, 10**6), max_size=NUM_PODS
    ),
    st.sampled_from([np.int64, np.float64]),
    st.sampled_from([0, prefix_rows.FEW_VALUES, 100]),
)
def test_each_value_lands_on_the_first_place_of_its_pods_row(
    rows: list[int],
    values: dict[PodId, int],
    dtype: type[np.int64 | np.float64],
    few_values: int,
) -> None:
    """Placed one by one (up to ``few_values``) or in arrays, alike: 0 where no value; a
    pod not in the table or not among the positions is ignored."""
    positions = np.array(sorted(rows), dtype=np.int64)
    ordered = positions.tolist()
    expected = [0] * len(ordered)
    for pod, value in values.items():
        row = TABLE.position.get(pod, -1)
        at = bisect_left(ordered, row)
        if at < len(ordered) and ordered[at] == row:
            expected[at] = value
    with mock.patch.object(prefix_rows, "FEW_VALUES", few_values):
        out = prefix_rows.per_row(TABLE, positions, values, dtype)
    assert out.dtype == dtype
    assert out.tolist() == expected
