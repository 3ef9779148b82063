"""Policies in isolation: each decides from the pod snapshot and its own records only."""

from __future__ import annotations

import numpy as np
import pytest

from extproc.pods import Pod, PodMetrics
from extproc.sim.engine import EngineConfig
from extproc.sim.offline import make_pods
from extproc.sim.policies import (
    CostAware,
    LeastRequest,
    PeerCacheAware,
    PrefixAffinity,
    PrefixView,
    RoundRobin,
    make_policy,
)
from testkit.factories import (
    MODEL,
    ROUND_TIMING,
    default_scheduler_config,
    make_item,
    random_words,
)

SYSTEM = random_words(1, 400)  # 1,600 bytes: exactly 25 view blocks of 64 bytes


def with_metrics(pods: list[Pod], *metrics: PodMetrics) -> list[Pod]:
    return [Pod(p.id, p.address, p.models, metrics=m) for p, m in zip(pods, metrics, strict=True)]


def test_round_robin_cycles() -> None:
    pods = make_pods(3, MODEL)
    policy = RoundRobin()
    item = make_item("r", 0.0, SYSTEM)
    assert [policy.pick(item, pods) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_request_counts_running_and_waiting() -> None:
    pods = with_metrics(
        make_pods(3, MODEL),
        PodMetrics(waiting=1, running=1),
        PodMetrics(running=3),
        PodMetrics(waiting=1),
    )
    assert LeastRequest(seed=0).pick(make_item("r", 0.0, SYSTEM), pods) == 2


def test_prefix_affinity_sends_a_new_prefix_home_then_follows_records() -> None:
    pods = make_pods(4, MODEL)
    view = PrefixView(10_000)
    policy = PrefixAffinity(view)
    a = make_item("a", 0.0, np.concatenate([SYSTEM, random_words(2, 10)]))
    b = make_item("b", 0.0, np.concatenate([SYSTEM, random_words(3, 10)]))
    home = policy.pick(a, pods)
    assert policy.pick(b, with_metrics(pods, *[PodMetrics(waiting=99)] * 4)) == home
    policy.finished(a, home, ok=True)
    policy.finished(b, home, ok=False)  # refused: only ``a`` is recorded
    other = (home + 1) % 4
    view.record(PrefixView.keys(make_item("x", 0.0, SYSTEM[:16])), pods[other].id)
    assert view.index.num_pod_entries(pods[home].id) == 25 + 1
    c = make_item("c", 0.0, np.concatenate([SYSTEM, random_words(4, 10)]))
    assert policy.pick(c, pods) == home  # 25 blocks beat 1


def test_cost_aware_leaves_the_cached_pod_once_its_queue_costs_more_than_a_miss() -> None:
    """Pod 0 holds the 400-token prefix: a request costs it 41 uncached tokens, pod 1 441.

    A step of n prefill tokens lasts 0.01 + 0.001 n, with a budget of 100 tokens, so
    TTFT(pod 1) = 5 * 0.01 + 0.441 = 0.491 s; TTFT(pod 0) with k requests waiting ahead
    has 41 (k + 1) tokens to go, over 0.491 s from k = 10 on.
    """
    engine = EngineConfig(timing_profile=ROUND_TIMING, max_num_batched_tokens=100)
    view = PrefixView(10_000)
    policy = CostAware(view, engine, seed=0)
    pods = make_pods(2, MODEL)
    view.record(PrefixView.keys(make_item("sys", 0.0, SYSTEM)), pods[0].id)
    picks: list[int] = []
    for k in range(12):
        item = make_item(f"r{k}", 0.0, np.concatenate([SYSTEM, random_words(10 + k, 41)]))
        waiting = picks.count(0)
        picks.append(
            policy.pick(item, with_metrics(pods, PodMetrics(waiting=waiting), PodMetrics()))
        )
    assert picks[:11] == [0] * 10 + [1]
    two_waiting = with_metrics(pods, PodMetrics(waiting=2), PodMetrics())[0]
    assert policy.estimate_ttft_s(two_waiting, 0, 41) == pytest.approx(2 * 0.01 + 0.001 * 123)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy 'random'"):
        make_policy(
            "random", scheduler_config=default_scheduler_config(), engine=EngineConfig(), seed=0
        )


def test_peer_cache_aware_follows_a_match_over_its_threshold_else_the_emptiest_pod() -> None:
    pods = make_pods(4, MODEL)
    policy = PeerCacheAware(seed=0)
    first = make_item("a", 0.0, np.concatenate([SYSTEM, random_words(2, 10)]))
    home = policy.pick(first, pods)  # inserted at pick, before it ends
    # 25 of 28 blocks match: over 0.3, the matching pod whatever its scraped load.
    warm = make_item("b", 0.0, np.concatenate([SYSTEM, random_words(3, 10)]))
    assert policy.pick(warm, with_metrics(pods, *[PodMetrics(waiting=99)] * 4)) == home
    # 25 of 125 blocks match: 0.2, under the threshold: a pod that holds nothing yet.
    cold = make_item("c", 0.0, np.concatenate([SYSTEM, random_words(4, 1600)]))
    assert policy.pick(cold, pods) != home


def test_peer_cache_aware_balances_by_its_own_count_when_imbalanced() -> None:
    pods = make_pods(2, MODEL)
    policy = PeerCacheAware(seed=0)
    picks = [
        policy.pick(make_item(f"r{i}", 0.0, np.concatenate([SYSTEM, random_words(i, 10)])), pods)
        for i in range(70)
    ]
    # All follow the shared prefix until that pod has 64 more in flight than the other.
    home = picks[0]
    assert picks[:65] == [home] * 65
    assert picks[65] != home
