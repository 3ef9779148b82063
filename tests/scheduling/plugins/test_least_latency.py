"""least-latency: TTFT and ITL normalised over the candidates, a flat 50 without both;
an invalid ``TTFTTPOTWeightFactor`` stops start-up with Kthena's message."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from extproc.errors import ConfigError
from extproc.pods import PodMetrics
from extproc.scheduling.config import parse_config
from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.plugins.least_latency import LeastLatency, LeastLatencyArgs
from testkit.factories import make_cycle, make_pod

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
        # Kthena: a pod missing TTFT or TPOT scores MaxScore / 2, and is left out of the
        # min/max, so the one pod with both is alone in its range: 100.
        pytest.param([(0.1, None), (0.3, 0.03)], None, [50, 100], id="half-data-flat-50"),
        pytest.param([(None, 0.01), (0.1, 0.02), (0.3, 0.03)], None, [50, 100, 0], id="ttft-only"),
        # Kthena's TestCalculateMinMaxMetricsSkipsNegativeLatency: <= 0 is no data
        pytest.param(
            [(10, 20), (-1, 5), (30, 40), (5, -1)], None, [100, 50, 0, 50], id="kthena-negative"
        ),
        pytest.param([(0.0, 0.02), (0.1, 0.02)], None, [50, 100], id="zero-is-no-data"),
        # Kthena's TestLeastLatencyScore table
        pytest.param([(10, 20)], None, [100], id="kthena-single-pod"),
        pytest.param([(10, 20), (10, 20)], None, [100, 100], id="kthena-identical"),
        pytest.param([(100, 10), (1, 20)], 0.0, [100, 0], id="kthena-only-tpot"),
        pytest.param([(100, 10), (1, 20)], 1.0, [0, 100], id="kthena-only-ttft"),
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
        pytest.param({"ttftTpotWeightFactor": 0.8}, 0.8, id="case-folded-as-go-json"),
        pytest.param({"TTFTTPOTWeightFacter": 0.8}, 0.5, id="misspelled"),
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


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        pytest.param("1.5", "must be a finite value between 0 and 1, got 1.5", id="above-1"),
        pytest.param("-0.1", "must be a finite value between 0 and 1, got -0.1", id="below-0"),
        pytest.param("2", "must be a finite value between 0 and 1, got 2", id="integer"),
        pytest.param("1.0e+6", "must be a finite value between 0 and 1, got 1e+06", id="go-exp"),
        pytest.param(".nan", "must be a finite value between 0 and 1, got NaN", id="nan"),
        pytest.param(".inf", "must be a finite value between 0 and 1, got +Inf", id="inf"),
        pytest.param("-.inf", "must be a finite value between 0 and 1, got -Inf", id="minus-inf"),
        pytest.param(
            "half",
            "json: cannot unmarshal string into Go struct field "
            "LeastLatencyArgs.TTFTTPOTWeightFactor of type float64",
            id="string",
        ),
        pytest.param(  # YAML 1.1 (PyYAML): no dot, no float; Kthena's YAML 1.2 reads 1e+06
            "1e6",
            "json: cannot unmarshal string into Go struct field "
            "LeastLatencyArgs.TTFTTPOTWeightFactor of type float64",
            id="yaml-1.1-exponent-is-a-string",
        ),
        pytest.param(
            "[0.5]",
            "json: cannot unmarshal array into Go struct field "
            "LeastLatencyArgs.TTFTTPOTWeightFactor of type float64",
            id="list",
        ),
    ],
)
def test_invalid_factor_stops_start_up_with_kthenas_message(args: str, problem: str) -> None:
    """Kthena's TestLoadSchedulerConfigRejectsInvalidLeastLatencyWeight: the entry is
    checked even when the plugin is not enabled."""
    text = f"scheduler:\n  pluginConfig:\n  - name: least-latency\n    args:\n      TTFTTPOTWeightFactor: {args}\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cm.yaml")
    assert str(info.value).startswith(
        "cm.yaml: failed to Load Scheduler: failed to Unmarshal PluginsConfig: "
        "invalid least-latency plugin configuration: "
    )
    assert str(info.value).endswith(problem)


@pytest.mark.parametrize(
    ("args", "factor"),
    [
        pytest.param("{TTFTTPOTWeightFactor: 0}", 0.0, id="zero"),
        pytest.param("{TTFTTPOTWeightFactor: 1.0}", 1.0, id="one"),
        pytest.param("{TTFTTPOTWeightFactor: null}", 0.5, id="null-keeps-default"),
        pytest.param("null", 0.5, id="null-args"),
        pytest.param("{}", 0.5, id="empty"),
    ],
)
def test_valid_factors_start(args: str, factor: float) -> None:
    text = f"scheduler:\n  pluginConfig:\n  - name: least-latency\n    args: {args}\n"
    raw = parse_config(text, "cm.yaml").plugin_args["least-latency"]
    assert make_plugin(raw).args == LeastLatencyArgs(factor)


def test_args_that_are_not_a_mapping_stop_start_up() -> None:
    text = "scheduler:\n  pluginConfig:\n  - name: least-latency\n    args: [1]\n"
    with pytest.raises(ConfigError, match="cannot unmarshal array into Go value of type"):
        parse_config(text, "cm.yaml")
