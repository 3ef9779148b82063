"""least-request: the waiting-queue filter and Kthena's on-flight score."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from extproc.pods import PodMetrics
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.plugins.least_request import LeastRequest, LeastRequestArgs
from testkit.factories import make_cycle, make_pod


def make_plugin(raw: object = None, in_flight: InFlight | None = None) -> LeastRequest:
    ctx = PluginContext(CollectorRegistry(), in_flight=in_flight or InFlight())
    return LeastRequest.from_args(raw, ctx)


@pytest.mark.parametrize(
    ("waiting", "limit", "kept"),
    [
        pytest.param([0, 9, 10, 11], None, [0, 9], id="default-10"),
        pytest.param([0, 2, 3], 3, [0, 2], id="limit-reached-is-removed"),
        pytest.param([5, 6], 5, [], id="all-removed"),
    ],
)
def test_filter_removes_full_queues(waiting: list[int], limit: int | None, kept: list[int]) -> None:
    plugin = make_plugin(None if limit is None else {"maxWaitingRequests": limit})
    pods = [make_pod(f"p{i}", metrics=PodMetrics(waiting=w)) for i, w in enumerate(waiting)]
    assert [p.metrics.waiting for p in plugin.filter(make_cycle("x"), pods)] == kept


# Kthena's least_request_test.go cases (on-flight, running) and edges of its formula
# base = on_flight + 100 * max(on_flight - running, 0), int((max - base) / max * 100).
@pytest.mark.parametrize(
    ("running", "in_flight", "expected"),
    [
        pytest.param([0, 0, 0], [0, 0, 0], [100, 100, 100], id="kthena-all-idle"),
        pytest.param([0], [0], [100], id="kthena-single-idle"),
        pytest.param([0, 0, 0], [0, 10, 5], [100, 0, 50], id="kthena-mixed-on-flight"),
        pytest.param([0, 0, 0], [1, 2, 3], [66, 33, 0], id="kthena-normal-truncated"),
        pytest.param([5, 0, 0], [5, 5, 0], [99, 0, 100], id="kthena-estimated-waiting"),
        pytest.param([4, 0], [0, 0], [100, 100], id="scraped-running-alone-is-neutral"),
        pytest.param([0, 9], [3, 3], [0, 99], id="running-covers-on-flight"),
        pytest.param([2, 2], [3, 3], [0, 0], id="equal-non-zero-all-0-as-kthena"),
    ],
)
def test_score(running: list[int], in_flight: list[int], expected: list[int]) -> None:
    counters = InFlight()
    pods = [make_pod(f"p{i}", metrics=PodMetrics(running=r)) for i, r in enumerate(running)]
    for pod, n in zip(pods, in_flight, strict=True):
        for _ in range(n):
            counters.start(pod.id)
    scores = make_plugin(in_flight=counters).score(make_cycle("x"), pods)
    assert [scores[p.id] for p in pods] == expected


def test_waiting_only_filters_and_does_not_score() -> None:
    """Kthena's score reads on-flight and running only; the queue is the filter's."""
    pods = [make_pod("a", metrics=PodMetrics(waiting=9)), make_pod("b")]
    scores = make_plugin().score(make_cycle("x"), pods)
    assert scores == {pods[0].id: 100, pods[1].id: 100}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(None, LeastRequestArgs(10), id="omitted"),
        pytest.param({"maxWaitingRequests": 4}, LeastRequestArgs(4), id="set"),
        pytest.param({"maxWaitingRequests": 0}, LeastRequestArgs(10), id="zero"),
        pytest.param({"maxWaitingRequest": 4}, LeastRequestArgs(10), id="misspelled"),
    ],
)
def test_args(raw: object, expected: LeastRequestArgs) -> None:
    assert make_plugin(raw).args == expected


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param({"maxWaitingRequests": "10"}, id="string"),
        pytest.param({"maxWaitingRequests": 2.5}, id="float"),
        pytest.param([10], id="list"),
    ],
)
def test_unparseable_args_fall_back_to_defaults_and_log(
    raw: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="extproc.scheduling.config"):
        assert make_plugin(raw).args == LeastRequestArgs()
    assert "Unmarshal LeastRequestArgs error, setting default value" in caplog.text  # Kthena's
