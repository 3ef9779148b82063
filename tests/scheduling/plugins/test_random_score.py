"""random: Kthena's uniform 0..100 score per pod, drawn anew for each request; seedable."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
from prometheus_client import CollectorRegistry

from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.plugins.random_score import Random
from extproc.scheduling.podtable import PodTable
from testkit.factories import make_cycle, make_pod

CTX = PluginContext(CollectorRegistry())
PODS = [make_pod(f"p{i}") for i in range(4)]


def seeded(seed: int) -> Random:
    return Random.from_args({"seed": seed}, CTX)


def test_scores_cover_0_to_100_uniformly() -> None:
    plugin = seeded(7)
    table = PodTable(PODS)
    draws = np.concatenate(
        [plugin.score_table(make_cycle("x"), table, table.all_positions()) for _ in range(5050)]
    )
    counts = Counter(draws.tolist())
    assert set(counts) == set(range(101))  # both ends included, as rand.Intn(101)
    expected = len(draws) / 101
    chi_square = sum((counts[v] - expected) ** 2 / expected for v in range(101))
    assert chi_square < 170  # chi-square, 100 degrees of freedom: p < 1e-5 beyond


def test_each_pod_and_each_request_draws_anew() -> None:
    plugin = seeded(3)
    cycle = make_cycle("x")
    first, second = plugin.score(cycle, PODS), plugin.score(cycle, PODS)
    assert set(first) == {p.id for p in PODS}
    assert first != second
    assert len(set(first.values())) > 1


def test_a_seed_repeats_the_scores_and_no_seed_does_not() -> None:
    table = PodTable(PODS)
    rows = table.all_positions()

    def run(plugin: Random) -> list[list[int]]:
        return [plugin.score_table(make_cycle("x"), table, rows).tolist() for _ in range(20)]

    assert run(seeded(11)) == run(seeded(11))
    assert run(seeded(11)) != run(seeded(12))
    unseeded = Random.from_args(None, CTX)
    assert run(unseeded) != run(Random.from_args(None, CTX))


def test_empty_candidates_score_nothing() -> None:
    assert seeded(1).score(make_cycle("x"), []) == {}


def test_concurrent_requests_get_full_score_sets() -> None:
    """Kthena's TestRandom_ConcurrentScore: one instance serves every thread."""
    plugin = seeded(5)
    table = PodTable(PODS)
    sizes: list[int] = []

    def score_many() -> None:
        for _ in range(50):
            sizes.append(len(plugin.score_table(make_cycle("x"), table, table.all_positions())))

    threads = [threading.Thread(target=score_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sizes == [len(PODS)] * 400
