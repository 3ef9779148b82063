"""InFlight counters: threads, tokens, bad ends; and a burst spreading before any scrape."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.pods import PodId
from extproc.scheduling.config import build_scheduler, parse_config
from extproc.scheduling.inflight import InFlight, InFlightCount
from testkit.factories import make_cycle, make_pod

PODS = [PodId("default", f"p{i}") for i in range(4)]


def test_counts_under_threads() -> None:
    in_flight = InFlight()
    num_threads, num_ops = 8, 5000
    barrier = threading.Barrier(num_threads)
    left_open: list[dict[PodId, int]] = []
    rows = {pod: i for i, pod in enumerate(PODS)}
    in_flight.counts_at(rows, len(PODS))  # its rows kept up to date by the threads

    def worker(seed: int) -> None:
        rng, open_ = random.Random(seed), dict.fromkeys(PODS, 0)
        barrier.wait()
        for _ in range(num_ops):
            pod = rng.choice(PODS)
            if open_[pod] and rng.random() < 0.5:
                in_flight.end(pod, 2)
                open_[pod] -= 1
            else:
                in_flight.start(pod, 2)
                open_[pod] += 1
        left_open.append(open_)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = {pod: sum(o[pod] for o in left_open) for pod in PODS}
    assert {pod: in_flight.get(pod) for pod in PODS} == expected
    assert in_flight.snapshot() == {
        pod: InFlightCount(n, 2 * n) for pod, n in expected.items() if n
    }
    requests, tokens = in_flight.counts_at(rows, len(PODS))
    assert requests.tolist() == [expected[pod] for pod in PODS]
    assert tokens.tolist() == [2 * expected[pod] for pod in PODS]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["start", "end", "read", "read_other"]), st.integers(0, 4)),
        max_size=40,
    )
)
def test_counts_per_row_follow_every_start_and_end(ops: list[tuple[str, int]]) -> None:
    """Rows read from the counts whatever table was read before: a table's pods (one
    missing, one never started), another table's, starts and ends in between."""
    in_flight = InFlight()
    pods = [*PODS, PodId("default", "gone")]
    tables = [{pod: i for i, pod in enumerate(pods[:4])}, {pods[4]: 0, pods[2]: 2, pods[0]: 3}]
    for op, i in ops:
        if op == "start":
            in_flight.start(pods[i], i + 1)
        elif op == "end":
            in_flight.end(pods[i], 1)
        else:
            rows = tables[op == "read_other"]
            requests, tokens = in_flight.counts_at(rows, 4)
            requests[:] = tokens[:] = -1  # the caller's copies
            counts = in_flight.snapshot()
            expected = [InFlightCount(0, 0)] * 4
            for pod, row in rows.items():
                expected[row] = counts.get(pod, InFlightCount(0, 0))
            assert list(zip(*in_flight.counts_at(rows, 4), strict=True)) == expected
            assert in_flight.requests_at(rows, 4).tolist() == [n for n, _ in expected]


def test_tokens_follow_requests_and_idle_pods_are_dropped() -> None:
    in_flight, pod = InFlight(), PODS[0]
    in_flight.start(pod, 100)
    in_flight.start(pod, 20)
    assert in_flight.get_count(pod) == InFlightCount(2, 120)
    in_flight.end(pod, 100)
    assert in_flight.get_count(pod) == InFlightCount(1, 20)
    in_flight.end(pod, 20)
    assert in_flight.get(pod) == 0 and in_flight.snapshot() == {}


def test_end_without_start_is_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    in_flight = InFlight()
    with caplog.at_level("WARNING", logger="extproc.scheduling"):
        in_flight.end(PODS[0])
    assert in_flight.get(PODS[0]) == 0 and "without a matching start" in caplog.text


DEFAULTS = """
scheduler:
  plugins:
    Filter: {enabled: [least-request]}
    Score:
      enabled:
        - {name: least-request, weight: 1}
        - {name: gpu-usage, weight: 1}
        - {name: least-latency, weight: 1}
        - {name: prefix-cache, weight: 1}
"""


def test_a_burst_between_scrapes_spreads_over_idle_pods() -> None:
    """Scrapes show every pod idle; the router's own counts spread the burst."""
    in_flight = InFlight()
    scheduler = build_scheduler(parse_config(DEFAULTS, "t.yaml"), CollectorRegistry(), in_flight)
    pods = [make_pod(f"p{i}", port=i + 1) for i in range(4)]
    for _ in range(8):
        cycle = make_cycle("same prompt " * 50)
        chosen = scheduler.schedule(cycle, pods)[0]
        in_flight.start(chosen.id, cycle.num_prefill_tokens(chosen.id))
    assert sorted(in_flight.get(p.id) for p in pods) == [2, 2, 2, 2]
