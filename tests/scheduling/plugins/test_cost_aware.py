"""cost-aware: estimated time to first token from queue, in-flight work and held prefix."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from extproc.pods import PodMetrics
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.plugins.cost_aware import CostAware, CostAwareArgs
from extproc.scheduling.plugins.prefix_cache import PrefixCacheScorer
from testkit.factories import make_cycle, make_pod

PROMPT = "w" * 4000  # 1,000 tokens at 4 bytes per token
PREFILL_MS = 0.025  # the defaults
DECODE_MS = 0.2


class Rig:
    """cost-aware with a real prefix-cache plugin and in-flight counters."""

    def __init__(self, *, with_prefix: bool = True, raw_args: object = None) -> None:
        ctx = PluginContext(CollectorRegistry(), in_flight=InFlight())
        self.prefix = PrefixCacheScorer.from_args(None, ctx) if with_prefix else None
        self.ctx = replace(ctx, prefix=self.prefix)
        self.plugin = CostAware.from_args(raw_args, self.ctx)


@pytest.mark.parametrize(
    ("held_bytes", "metrics", "in_flight", "expected_ms"),
    [
        pytest.param(
            [0, 0], [PodMetrics(), PodMetrics()], [(0, 0), (0, 0)], [25.0, 25.0], id="idle-cold"
        ),
        pytest.param(
            [4000, 0], [PodMetrics(), PodMetrics()], [(0, 0), (0, 0)], [0.0, 25.0], id="warm-pod"
        ),
        pytest.param(
            [2048, 0], [PodMetrics(), PodMetrics()], [(0, 0), (0, 0)], [12.2, 25.0], id="half-warm"
        ),
        pytest.param(
            [4000, 0],
            [PodMetrics(waiting=1), PodMetrics()],
            [(0, 0), (0, 0)],
            [25.0 + DECODE_MS, 25.0],
            id="warm-but-queued",
        ),
        pytest.param(
            [4000, 0],
            [PodMetrics(running=10), PodMetrics(running=1)],
            [(0, 0), (0, 0)],
            [10 * DECODE_MS, 25.0 + DECODE_MS],
            id="running-adds-decode-steps",
        ),
        pytest.param(
            [4000, 0],
            [PodMetrics(), PodMetrics()],
            [(3, 150), (0, 0)],
            [3 * 50 * PREFILL_MS + 3 * DECODE_MS, 25.0],
            id="burst-of-warm-hits-is-cheap",
        ),
        pytest.param(
            [4000, 0],
            [PodMetrics(running=3), PodMetrics()],
            [(3, 3000), (0, 0)],
            [3 * DECODE_MS, 25.0],
            id="in-flight-already-running",
        ),
        pytest.param(
            [0, 0],
            [PodMetrics(waiting=2), PodMetrics()],
            [(0, 0), (4, 2000)],
            [25.0 + 2 * 25.0 + 2 * DECODE_MS, 25.0 + 4 * 500 * PREFILL_MS + 4 * DECODE_MS],
            id="queue-of-others-sized-by-this-prompt",
        ),
    ],
)
def test_estimates(
    held_bytes: list[int],
    metrics: list[PodMetrics],
    in_flight: list[tuple[int, int]],
    expected_ms: list[float],
) -> None:
    rig = Rig()
    assert rig.prefix is not None
    pods = [make_pod(f"p{i}", port=i + 1, metrics=m) for i, m in enumerate(metrics)]
    for pod, held, (n, tokens) in zip(pods, held_bytes, in_flight, strict=True):
        if held:
            rig.prefix.record(make_cycle(PROMPT[:held]), pod.id)
        for i in range(n):
            rig.ctx.in_flight.start(pod.id, tokens // n + (i < tokens % n))
    estimates = rig.plugin.estimate_ms(make_cycle(PROMPT), pods)
    assert [estimates[p.id] for p in pods] == pytest.approx(expected_ms)


@pytest.mark.parametrize(
    ("estimates_waiting", "expected"),
    [
        pytest.param([0, 0, 0], [100, 100, 100], id="equal-all-100"),
        pytest.param([0, 1, 2], [100, 50, 0], id="linear-cheapest-100"),
    ],
)
def test_scores_map_estimates_linearly(estimates_waiting: list[int], expected: list[int]) -> None:
    rig = Rig(with_prefix=False)
    pods = [
        make_pod(f"p{i}", port=i + 1, metrics=PodMetrics(waiting=w))
        for i, w in enumerate(estimates_waiting)
    ]
    scores = rig.plugin.score(make_cycle(PROMPT), pods)
    assert [scores[p.id] for p in pods] == expected


def test_leaves_uncached_tokens_for_in_flight_accounting() -> None:
    rig = Rig()
    assert rig.prefix is not None
    warm, cold, unscored = (make_pod(n, port=i + 1) for i, n in enumerate(("a", "b", "c")))
    rig.prefix.record(make_cycle(PROMPT[:1024]), warm.id)
    cycle = make_cycle(PROMPT)
    rig.plugin.score(cycle, [warm, cold])
    assert cycle.uncached_tokens == {warm.id: 744, cold.id: 1000}
    assert cycle.num_prefill_tokens(warm.id) == 744
    assert cycle.num_prefill_tokens(unscored.id) == 1000  # the whole prompt


def test_works_without_prefix_plugin_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    pods = [make_pod("a", port=1), make_pod("b", port=2)]
    with caplog.at_level("INFO", logger="extproc.scheduling"):
        rig = Rig(with_prefix=False)
        rig.plugin.score(make_cycle(PROMPT), pods)
        rig.plugin.score(make_cycle(PROMPT), pods)
    assert caplog.text.count("no prefix-cache plugin configured") == 1


def test_prompt_longer_than_the_hashed_window_counts_its_tail_uncached() -> None:
    rig = Rig()
    assert rig.prefix is not None
    pod = make_pod("a")
    long_prompt = "v" * 20_000  # window: 64 * 128 = 8,192 bytes
    rig.prefix.record(make_cycle(long_prompt), pod.id)
    cycle = make_cycle(long_prompt)
    rig.plugin.score(cycle, [pod])
    assert cycle.uncached_tokens[pod.id] == (20_000 - 8_192) // 4


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(None, CostAwareArgs(0.025, 0.2), id="omitted"),
        pytest.param({"prefillMsPerToken": 0.1}, CostAwareArgs(0.1, 0.2), id="set"),
        pytest.param({"decodeMsPerToken": 1}, CostAwareArgs(0.025, 1.0), id="int-for-float"),
        pytest.param({"prefillMsPerToken": -1}, CostAwareArgs(), id="negative"),
        pytest.param({"prefillMsPerToken": float("inf")}, CostAwareArgs(), id="infinite"),
        pytest.param({"podBudgetTokens": 4096, "mode": "score"}, CostAwareArgs(), id="kthena-keys"),
    ],
)
def test_args(raw: object, expected: CostAwareArgs) -> None:
    assert Rig(raw_args=raw).plugin.args == expected


def test_unparseable_args_fall_back_and_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="extproc.scheduling.config"):
        assert Rig(raw_args={"prefillMsPerToken": "fast"}).plugin.args == CostAwareArgs()
    assert "Failed to unmarshal CostAwareArgs, using default values" in caplog.text
