"""``Arrivals`` against a plain model of its rows: each group a list of (keys, pod) in
row order, a removal dropping the first row of the same pod, length and last key (the
last row taking its place), a match the longest common prefix per pod. Keys come from a
small alphabet, so rows that share a length and last key but differ before it (what
chained hashes never produce) occur and must be removed in the same order."""

from __future__ import annotations

from collections.abc import Container

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.pods import PodId
from extproc.scheduling.plugins.arrivals import MIN_ROWS, Arrivals

PODS = [PodId("ns", f"pod-{i}") for i in range(3)]


class Model:
    """The rows as plain lists (module doc)."""

    def __init__(self) -> None:
        self.groups: dict[int, list[tuple[tuple[int, ...], PodId]]] = {}

    def add(self, keys: tuple[int, ...], pod: PodId) -> None:
        self.groups.setdefault(keys[0], []).append((keys, pod))

    def remove(self, keys: tuple[int, ...], pod: PodId) -> None:
        rows = self.groups.get(keys[0], [])
        for i, (row, at) in enumerate(rows):
            if at == pod and len(row) == len(keys) and row[-1] == keys[-1]:
                rows[i] = rows[-1]
                rows.pop()
                return

    def match(self, keys: tuple[int, ...]) -> dict[PodId, int]:
        longest: dict[PodId, int] = {}
        for row, pod in self.groups.get(keys[0], []):
            shared = next((i for i, (a, b) in enumerate(zip(row, keys)) if a != b), None)
            shared = min(len(row), len(keys)) if shared is None else shared
            if shared > longest.get(pod, 0):
                longest[pod] = shared
        return longest

    def forget_pods(self, keep: Container[PodId]) -> None:
        for first, rows in self.groups.items():
            self.groups[first] = [(row, pod) for row, pod in rows if pod in keep]

    @property
    def num_requests(self) -> int:
        return sum(map(len, self.groups.values()))


key_lists = st.lists(st.integers(0, 3), min_size=1, max_size=2 * MIN_ROWS).map(tuple)
pods = st.sampled_from(PODS)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), key_lists, pods),
        st.tuples(st.just("remove"), key_lists, pods),
        st.tuples(st.just("remove_added"), st.integers(0, 1000), pods),
        st.tuples(st.just("forget"), st.frozensets(pods), pods),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(operations, st.lists(key_lists, min_size=1, max_size=4))
def test_arrivals_match_the_model_of_their_rows(
    ops: list[tuple[str, object, PodId]], queries: list[tuple[int, ...]]
) -> None:
    check_against_the_model(ops, queries)


def check_against_the_model(
    ops: list[tuple[str, object, PodId]], queries: list[tuple[int, ...]]
) -> None:
    arrivals, model, added = Arrivals(), Model(), []
    for name, arg, pod in ops:
        if name == "add":
            assert isinstance(arg, tuple)
            arrivals.add(np.array(arg, dtype=np.int64), pod)
            model.add(arg, pod)
            added.append((arg, pod))
        elif name in ("remove", "remove_added"):
            if name == "remove_added":
                if not added:
                    continue
                assert isinstance(arg, int)
                arg, pod = added[arg % len(added)]
            assert isinstance(arg, tuple)
            arrivals.remove(np.array(arg, dtype=np.int64), pod)
            model.remove(arg, pod)
        else:
            assert isinstance(arg, frozenset)
            arrivals.forget_pods(arg)
            model.forget_pods(arg)
        assert arrivals.num_requests == model.num_requests
        for keys in [*queries, *(row for row, _ in added[-3:])]:
            assert arrivals.match(np.array(keys, dtype=np.int64)) == model.match(keys)


def test_a_removal_drops_the_first_row_of_its_pod_length_and_last_key() -> None:
    arrivals = Arrivals()
    arrivals.add(np.array([1, 2, 3]), PODS[0])
    arrivals.add(np.array([1, 5, 3]), PODS[0])
    arrivals.remove(np.array([1, 9, 3]), PODS[0])
    assert arrivals.match(np.array([1, 5, 3])) == {PODS[0]: 3}
    assert arrivals.match(np.array([1, 2, 3])) == {PODS[0]: 1}
