"""least-latency: TTFT and ITL normalised over the candidates, 50 without data."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from extproc.scheduling.plugins.least_latency import LeastLatency, LeastLatencyArgs
from extproc.scheduling.types import PluginContext
from extproc.types import PodMetrics
from tests.factories import make_cycle, make_pod

Latency = tuple[float | None, float | None]  # (ttft_s, itl_s)


def make_plugin(raw: object = None) -> LeastLatency:
    return LeastLatency.from_args(raw, PluginContext(CollectorRegistry()))


@pytest.mark.parametrize(
    ("latencies", "factor", "expected"),
    [
        pytest.param([(0.1, 0.01), (0.3, 0.03)], None, [100, 0], id="both-lower-wins"),
        pytest.param([(0.1, 0.03), (0.3, 0.01)], None, [50, 50], id="trade-off-balanced"),
        pytest.param([(0.1, 0.03), (0.3, 0.01)], 1.0, [100, 0], id="ttft-only"),
        pytest.param([(0.1, 0.03), (0.3, 0.01)], 0.0, [0, 100], id="itl-only"),
        pytest.param([(0.1, 0.02), (0.2, 0.02), (0.3, 0.02)], None, [100, 75, 50], id="spread"),
        pytest.param([(0.2, 0.02), (0.2, 0.02)], None, [100, 100], id="equal-is-100"),
        pytest.param([(None, None), (0.1, 0.01), (0.3, 0.03)], None, [50, 100, 0], id="no-data"),
        pytest.param([(None, None), (None, None)], None, [50, 50], id="nobody-has-data"),
        pytest.param([(0.1, None), (0.3, 0.03)], None, [75, 50], id="half-data"),
    ],
)
def test_score(latencies: list[Latency], factor: float | None, expected: list[int]) -> None:
    raw = None if factor is None else {"TTFTTPOTWeightFactor": factor}
    pods = [
        make_pod(f"p{i}", metrics=PodMetrics(ttft_s=ttft, itl_s=itl))
        for i, (ttft, itl) in enumerate(latencies)
    ]
    scores = make_plugin(raw).score(make_cycle("x"), pods)
    assert [scores[p.id] for p in pods] == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(None, 0.5, id="omitted"),
        pytest.param({"TTFTTPOTWeightFactor": 0.8}, 0.8, id="set"),
        pytest.param({"TTFTTPOTWeightFactor": 0}, 0.0, id="zero-is-valid"),
        pytest.param({"TTFTTPOTWeightFactor": 1}, 1.0, id="one-is-valid"),
        pytest.param({"ttftTpotWeightFactor": 0.8}, 0.5, id="misspelled"),
    ],
)
def test_args(raw: object, expected: float) -> None:
    assert make_plugin(raw).args == LeastLatencyArgs(expected)


@pytest.mark.parametrize(
    "value",
    [pytest.param(1.5, id="above-1"), pytest.param(-0.1, id="negative"), pytest.param(math.nan)],
)
def test_out_of_range_factor_uses_default_and_logs(
    value: float, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="extproc.scheduling.config"):
        assert make_plugin({"TTFTTPOTWeightFactor": value}).args == LeastLatencyArgs()
    assert (
        "Invalid TTFTTPOTWeightFactor" in caplog.text and "using default value 0.5" in caplog.text
    )


def test_unparseable_args_fall_back_and_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="extproc.scheduling.config"):
        assert make_plugin({"TTFTTPOTWeightFactor": "half"}).args == LeastLatencyArgs()
    assert "Failed to unmarshal LeastLatencyArgs, using default values" in caplog.text
