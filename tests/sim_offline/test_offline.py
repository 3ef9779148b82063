"""The replay loop: causality of completions, the lab's lessons, hit ratios, rejections."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from extproc.pods import Pod
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.config import parse_config
from extproc.scheduling.plugins.prefix_cache import PrefixCacheScorer
from extproc.sim.engine import Engine, EngineConfig
from extproc.sim.offline import SimSettings, compare, simulate
from extproc.sim.policies import (
    POLICY_NAMES,
    CostAware,
    Policy,
    PrefixAffinity,
    PrefixCachePolicy,
    make_policy,
)
from extproc.sim.report import summarize
from extproc.sim.traces import TRACE_FILES, trace_workload
from extproc.sim.workloads import (
    BurstParams,
    ChatParams,
    WorkItem,
    Workload,
    burst_workload,
    chat_workload,
)
from testkit.factories import (
    default_scheduler_config,
    make_item,
    make_workload,
    random_words,
    sim_settings,
)

Summaries = dict[str, dict[str, Any]]


class Spy:
    """Wraps a policy; notes, at each pick, how many entries its prefix index holds."""

    name: ClassVar[str] = "spy"

    def __init__(self, inner: Policy, index: Callable[[Policy], PrefixIndex]) -> None:
        self.inner = inner
        self.index = index
        self.entries_at_pick: dict[str, int] = {}
        self.picked: dict[str, int] = {}

    def pick(self, item: WorkItem, pods: Sequence[Pod]) -> int:
        self.entries_at_pick[item.request_id] = self.index(self.inner).num_entries
        self.picked[item.request_id] = self.inner.pick(item, pods)
        return self.picked[item.request_id]

    def finished(self, item: WorkItem, pod_idx: int, ok: bool) -> None:
        self.inner.finished(item, pod_idx, ok)


def plugin_index(policy: Policy) -> PrefixIndex:
    assert isinstance(policy, PrefixCachePolicy)
    (scorer,) = policy.scheduler.recorders
    assert isinstance(scorer, PrefixCacheScorer)
    return scorer.index


def view_index(policy: Policy) -> PrefixIndex:
    assert isinstance(policy, (PrefixAffinity, CostAware))
    return policy.view.index


LEARNING = [
    pytest.param("prefix-cache", plugin_index, id="prefix-cache"),
    pytest.param("prefix-affinity", view_index, id="prefix-affinity"),
    pytest.param("cost-aware", view_index, id="cost-aware"),
]


@pytest.mark.parametrize(("name", "index"), LEARNING)
def test_a_prefix_is_recorded_only_once_its_response_ended(
    name: str, index: Callable[[Policy], PrefixIndex]
) -> None:
    """r1 arrives during r0's last step (r0 finished "in the future"), r2 at r0's end."""
    sim = sim_settings(num_pods=2)
    prompt = random_words(7, 512)
    solo = Engine(sim.engine)
    solo.add_request(make_item("r0", 0.0, prompt, max_tokens=20).sim, 0.0)
    (r0_end,) = [f.finished_s for r in solo.advance_to(1e9) for f in r.finished]
    items = [
        make_item("r0", 0.0, prompt, max_tokens=20),
        make_item("r1", r0_end - 1e-4, prompt),  # a step lasts at least the base of its profile
        make_item("r2", r0_end, prompt),
    ]
    policy = make_policy(
        name, scheduler_config=default_scheduler_config(), engine=sim.engine, seed=0
    )
    spy = Spy(policy, index)
    result = simulate(make_workload(items), spy, sim)
    assert spy.entries_at_pick == {"r0": 0, "r1": 0, "r2": 2048 // 64}  # r0's 32 blocks
    assert {r.request_id: r.finished_s for r in result.requests}["r0"] == r0_end


class LoadSeen:
    """Round robin that notes the load (running + waiting) of every pod at each pick."""

    name: ClassVar[str] = "load-seen"

    def __init__(self) -> None:
        self.loads: list[list[int]] = []

    def pick(self, item: WorkItem, pods: Sequence[Pod]) -> int:
        self.loads.append([p.metrics.running + p.metrics.waiting for p in pods])
        return (len(self.loads) - 1) % len(pods)

    def finished(self, item: WorkItem, pod_idx: int, ok: bool) -> None:
        return None


def test_a_request_ending_with_the_step_in_progress_is_still_running() -> None:
    """r1 comes during r0's last step on pod 0, r2 at its end."""
    sim = sim_settings(num_pods=2)
    solo = Engine(sim.engine)
    solo.add_request(make_item("r0", 0.0, random_words(1, 64), max_tokens=5).sim, 0.0)
    (r0_end,) = [f.finished_s for r in solo.advance_to(1e9) for f in r.finished]
    items = [
        make_item("r0", 0.0, random_words(1, 64), max_tokens=5),
        make_item("r1", r0_end - 1e-4, random_words(2, 64)),
        make_item("r2", r0_end, random_words(3, 64)),
    ]
    policy = LoadSeen()
    simulate(make_workload(items), policy, sim)
    assert policy.loads == [[0, 0], [1, 0], [0, 1]]


class CapacitySeen(LoadSeen):
    """Round robin that notes every pod's scraped KV capacity at each pick."""

    def pick(self, item: WorkItem, pods: Sequence[Pod]) -> int:
        self.loads.append([p.metrics.kv_capacity_tokens or 0 for p in pods])
        return 0


def test_every_pod_shows_its_kv_capacity_from_the_first_pick() -> None:
    """As a scraper reads ``vllm:cache_config_info`` on its first sweep, pods never sent a
    request included."""
    sim = SimSettings(3, EngineConfig(num_gpu_blocks=100, block_size=16), scrape_interval_s=60.0)
    items = [make_item(f"r{i}", 0.01 * i, random_words(i, 64)) for i in range(3)]
    policy = CapacitySeen()
    simulate(make_workload(items), policy, sim)
    assert policy.loads == [[1600, 1600, 1600]] * 3


def test_a_refused_request_is_counted_and_never_recorded() -> None:
    sim = sim_settings(num_pods=1, num_gpu_blocks=8, block_size=16)  # 128 tokens of KV
    items = [make_item("big", 0.0, random_words(1, 200)), make_item("ok", 1.0, random_words(2, 50))]
    policy = make_policy(
        "prefix-cache", scheduler_config=default_scheduler_config(), engine=sim.engine, seed=0
    )
    result = simulate(make_workload(items), policy, sim)
    assert [r.request_id for r in result.requests] == ["ok"]
    assert (result.pods[0].num_requests, result.pods[0].num_rejected) == (2, 1)
    assert plugin_index(policy).num_entries == len(items[1].request.prompt.encode()) // 64 + 1


def summaries(workload: Workload, num_pods: int, names: Sequence[str]) -> Summaries:
    engine = EngineConfig(**workload.engine_defaults)
    runs = compare(
        workload, names, SimSettings(num_pods, engine), default_scheduler_config(), seed=0
    )
    return {run.policy: summarize(run) for run in runs}


@pytest.fixture(scope="module")
def burst() -> Summaries:
    return summaries(burst_workload(BurstParams(num_requests=400), seed=0), 4, POLICY_NAMES)


def test_pure_affinity_overloads_one_replica_in_the_burst(burst: Summaries) -> None:
    affinity, aware = burst["prefix-affinity"], burst["cost-aware"]
    assert affinity["ttft_s"]["max"] > 2 * aware["ttft_s"]["max"]
    busiest = max(p["num_requests"] for p in affinity["pods"])
    assert busiest > 0.5 * 400 > max(p["num_requests"] for p in aware["pods"])


def test_cost_aware_beats_round_robin_and_pure_affinity_on_mean_ttft(
    burst: Summaries,
) -> None:
    mean = {name: s["ttft_s"]["mean"] for name, s in burst.items()}
    assert mean["cost-aware"] < mean["round-robin"]
    assert mean["cost-aware"] < mean["prefix-affinity"]


def test_every_request_is_served_once(burst: Summaries) -> None:
    for s in burst.values():
        # the default config's queue filter may refuse some of the burst (429), as the
        # server would; every other request is routed once and finishes
        assert s["num_finished"] == sum(p["num_requests"] for p in s["pods"])
        assert s["num_finished"] + s["num_refused"] == 400
        assert s["prefix_cache_queries"] > s["prefix_cache_hits"] > 0


def test_prefix_cache_beats_round_robin_on_hit_ratio_in_the_burst(burst: Summaries) -> None:
    assert burst["prefix-cache"]["hit_ratio"] > burst["round-robin"]["hit_ratio"] + 0.03


def test_prefix_cache_beats_round_robin_on_hit_ratio_in_chats() -> None:
    got = summaries(
        chat_workload(ChatParams(num_requests=200), seed=0), 4, ["round-robin", "prefix-cache"]
    )
    assert got["prefix-cache"]["hit_ratio"] > got["round-robin"]["hit_ratio"] + 0.05


def test_prefix_cache_beats_round_robin_on_hit_ratio_in_the_conversation_trace(
    trace_dir: Path,
) -> None:
    path = trace_dir / TRACE_FILES["mooncake-conversation"]
    workload = trace_workload(path, scale=16, limit=400, model="m")
    got = summaries(workload, 4, ["round-robin", "prefix-cache"])
    assert got["prefix-cache"]["hit_ratio"] > 1.5 * got["round-robin"]["hit_ratio"]


def test_stale_metrics_send_a_burst_to_one_least_request_pod() -> None:
    """Scraped once a minute, every pod looks idle: least-request keeps its tie-break."""
    items = [make_item(f"r{i}", 0.001 * i, random_words(i, 64)) for i in range(40)]
    fresh, stale = (
        simulate(
            make_workload(items),
            make_policy(
                "least-request",
                scheduler_config=default_scheduler_config(),
                engine=EngineConfig(),
                seed=0,
            ),
            SimSettings(4, EngineConfig(), scrape_interval_s=interval),
        )
        for interval in (0.0, 60.0)
    )
    assert max(p.num_requests for p in fresh.pods) <= 11
    assert max(p.num_requests for p in stale.pods) > 11
    assert np.isclose(sum(p.num_requests for p in stale.pods), 40)


def test_default_weights_plus_cost_aware_spread_a_hot_prefix_and_keep_most_hits() -> None:
    """Issue 5's check: the shipped cost-aware configuration on the burst scenario."""
    text = resources.files("extproc").joinpath("data/cost-aware.yaml").read_text()
    workload = burst_workload(BurstParams(num_requests=400), seed=0)
    settings = SimSettings(4, EngineConfig(**workload.engine_defaults))
    runs = compare(workload, ["prefix-affinity"], settings, default_scheduler_config(), seed=0)
    runs += compare(workload, ["prefix-cache"], settings, parse_config(text, "cost-aware"), seed=0)
    affinity, ours = (summarize(r) for r in runs)
    assert ours["num_refused"] == 0
    assert max(p["num_requests"] for p in ours["pods"]) < 0.4 * 400
    assert max(p["num_requests"] for p in affinity["pods"]) > 0.5 * 400
    assert ours["ttft_s"]["max"] < affinity["ttft_s"]["max"] / 2
    assert ours["hit_ratio"] > 0.9 * affinity["hit_ratio"]
