"""Bands are strict; within a band, flows share tokens fairly."""

from __future__ import annotations

from collections import Counter

from extproc.routing.flow.held import Held
from extproc.routing.flow.queue import Entry, ModelQueue


def entry(priority: int, key: str, cost: int = 100, size: int = 10) -> Entry:
    return Entry(Held(0.0, priority), "m", priority, key, cost, size, 0.0, lambda: None)


def test_a_higher_band_is_always_served_first() -> None:
    queue = ModelQueue()
    low = [entry(0, "a") for _ in range(3)]
    for e in low:
        queue.push(e)
    high = entry(10, "b")
    queue.push(high)
    assert queue.pop() is high
    assert [queue.pop() for _ in range(3)] == low  # one flow: first in, first out
    assert queue.pop() is None and queue.count == 0


def test_a_noisy_flow_gets_the_same_share_of_tokens_as_the_others() -> None:
    queue = ModelQueue()
    for _ in range(50):
        queue.push(entry(0, "noisy"))
    for key in ("a", "b", "c"):
        for _ in range(10):
            queue.push(entry(0, key))
    served = Counter(e.fairness_key for e in (queue.pop() for _ in range(40)) if e)
    assert served == {"noisy": 10, "a": 10, "b": 10, "c": 10}


def test_fairness_counts_tokens_not_requests() -> None:
    queue = ModelQueue()
    for _ in range(20):
        queue.push(entry(0, "big", cost=400))
        queue.push(entry(0, "small", cost=100))
    tokens: Counter[str] = Counter()
    for _ in range(15):
        e = queue.pop()
        assert e is not None
        tokens[e.fairness_key] += e.cost
    assert abs(tokens["big"] - tokens["small"]) <= 400


def test_an_idle_flow_banks_no_credit() -> None:
    queue = ModelQueue()
    for _ in range(10):
        queue.push(entry(0, "busy"))
    for _ in range(5):
        queue.pop()
    late = [entry(0, "late") for _ in range(5)]
    for e in late:
        queue.push(e)
    order = [e.fairness_key for e in (queue.pop() for _ in range(6)) if e]
    assert order.count("late") == 3  # alternates with busy, not 5 in a row


def test_discarded_entries_are_skipped_and_the_lowest_newest_is_evicted_first() -> None:
    queue = ModelQueue()
    a, b, c = entry(0, "a"), entry(0, "b"), entry(5, "c")
    for e in (a, b, c):
        queue.push(e)
    assert queue.lowest() is b
    queue.discard(b)
    assert queue.count == 2 and queue.lowest() is a
    assert queue.pop() is c and queue.pop() is a and queue.pop() is None
    assert list(queue.bands()) == [(5, 0, 0), (0, 0, 0)]
