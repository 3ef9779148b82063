"""``RowValues``: a table pass's values read by pod id."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import replace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from extproc.pods import PodId
from extproc.scheduling.podtable import PodTable, RowValues
from testkit.factories import MODEL, make_pod

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


def test_every_pod_a_candidate_reads_its_columns_by_copy_not_gather() -> None:
    """All ready, none a prefill pod: the candidates are ``every_row`` (one object), and
    ``rows`` over it is a copy of the column, never the column itself."""
    table = PodTable([make_pod(f"p{i}") for i in range(NUM_PODS)])
    found = table.candidates(MODEL)
    assert found.all is table.every_row and found.serving is table.every_row
    column = np.arange(NUM_PODS, dtype=np.int64) * 3
    read = table.rows(column, found.serving)
    assert read.tolist() == column.tolist() and read is not column
    read[0] = -1
    assert column[0] == 0


def test_a_pod_left_out_is_gathered_around() -> None:
    pods = [make_pod(f"p{i}") for i in range(NUM_PODS)]
    pods[2] = replace(pods[2], ready=False)
    table = PodTable(pods)
    found = table.candidates(MODEL)
    assert found.all is not table.every_row and found.all.tolist() == [0, 1, 3, 4, 5]
    column = np.arange(NUM_PODS, dtype=np.int64) * 3
    assert table.rows(column, found.all).tolist() == [0, 3, 9, 12, 15]
