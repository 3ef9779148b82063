"""RecentPicks: the last picks with their ends, bounded, and per pod the predicted tokens."""

from __future__ import annotations

import pytest

from extproc.admin.recent import Predicted, RecentPicks
from extproc.pods import PodId
from extproc.routing.observe import Ended, EndTiming, Routed
from testkit.factories import make_pod

A, B = make_pod("a"), make_pod("b", port=8001)


def routed(request_id: str | None, *, predicted: int = 0, prompt: int = 100) -> Routed:
    return Routed(
        request_id=request_id,
        model="m",
        headers={},
        arrived_unix_ns=1_700_000_000_000_000_000,
        arrived_s=1.0,
        decided_s=1.001,
        queued_s=0.25,
        preparing_s=0.002,
        num_candidates=2,
        pods=(A, B),
        prefill=None,
        pinned=False,
        prompt_tokens=prompt,
        predicted_cached_tokens=predicted,
        exact=False,
    )


def ended(
    request_id: str,
    pod: PodId | None = A.id,
    *,
    succeeded: bool = True,
    prompt: int | None = 100,
    predicted: int | None = 40,
) -> Ended:
    timing = EndTiming(0.1, 0.5, 300, 900, 200 if succeeded else 503)
    return Ended(request_id, "m", pod, succeeded, 1, timing, prompt, predicted)


def test_picks_are_listed_newest_first_with_their_ends() -> None:
    recent = RecentPicks()
    recent.routed(routed("r1", predicted=40))
    recent.routed(routed("r2"))
    recent.routed(routed(None))
    recent.ended(ended("r1", B.id))
    (none, second, first) = recent.recent()
    assert none[0].request_id is None and none[1] is None
    assert second[0].request_id == "r2" and second[1] is None  # not ended yet
    pick, end = first
    assert pick.pods == (A.id, B.id) and pick.predicted_cached_tokens == 40
    assert pick.queued_s == 0.25 and pick.at_unix_s == pytest.approx(1.7e9)
    assert end is not None and end.served_by == B.id and end.succeeded
    assert end.duration_s == 0.5


def test_picks_and_ends_are_bounded() -> None:
    recent = RecentPicks(size=3)
    for i in range(10):
        recent.routed(routed(f"r{i}"))
        recent.ended(ended(f"r{i}"))
    picks = recent.recent()
    assert [p.request_id for p, _ in picks] == ["r9", "r8", "r7"]
    assert all(end is not None for _, end in picks)
    assert len(recent._ends) <= 6


def test_predicted_counts_successful_ends_routed_here_on_the_serving_pod() -> None:
    recent = RecentPicks()
    recent.ended(ended("1", A.id, prompt=100, predicted=40))
    recent.ended(ended("2", A.id, prompt=50, predicted=None))  # no prediction: 0 cached
    recent.ended(ended("3", B.id, prompt=10, predicted=10))
    recent.ended(ended("4", A.id, succeeded=False))
    recent.ended(ended("5", A.id, prompt=None, predicted=None))  # routed elsewhere
    recent.ended(ended("6", None))  # serving pod unknown
    predicted = recent.predicted()
    assert predicted == {A.id: Predicted(150, 40), B.id: Predicted(10, 10)}
    assert predicted[A.id].ratio == pytest.approx(40 / 150)
    assert Predicted().ratio is None
