"""Configuration loading: the spec's semantics and every start-up error."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from extproc.errors import ConfigError
from extproc.scheduling.config import build_scheduler, load_config, parse_config
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.plugins.cost_aware import CostAware
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT, EstimatedTTFTArgs
from extproc.scheduling.plugins.gpu_usage import GPUCacheUsage
from extproc.scheduling.plugins.least_latency import LeastLatency, LeastLatencyArgs
from extproc.scheduling.plugins.least_request import LeastRequest, LeastRequestArgs
from extproc.scheduling.plugins.lora_affinity import LoraAffinity
from extproc.scheduling.plugins.prefix_cache import PrefixCacheArgs, PrefixCacheScorer
from testkit.factories import make_cycle, make_pod


def weight_config(weight_line: str) -> str:
    return f"""
scheduler:
  plugins:
    Score:
      enabled:
        - name: prefix-cache
{weight_line}
"""


def test_embedded_default_is_the_estimated_ttft_cost_model_every_argument_written() -> None:
    config = load_config()
    assert config.filters == ()
    assert [(s.name, s.weight) for s in config.scores] == [
        ("estimated-ttft", 1),
        ("lora-affinity", 6),
    ]
    written = config.plugin_args["estimated-ttft"]
    # every argument at its default but the slot wait: lora-affinity ranks the slots
    defaults = {f.name: f.default for f in dataclasses.fields(EstimatedTTFTArgs)}
    assert written == defaults | {"loraSlotWaitMs": 0.0}
    ttft, lora = build_scheduler(config, CollectorRegistry()).scorers
    assert isinstance(ttft.scorer, EstimatedTTFT)
    assert ttft.scorer.args == EstimatedTTFTArgs(loraSlotWaitMs=0.0)
    assert isinstance(lora.scorer, LoraAffinity)


@pytest.mark.parametrize("name", ["kthena", "cost-aware", "default"])
def test_shipped_configurations_are_selected_by_name(name: str) -> None:
    config = load_config(name)
    assert config.source == f"<embedded {name} configuration>"
    build_scheduler(config, CollectorRegistry())


def test_a_file_named_like_a_shipped_configuration_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kthena").write_text(weight_config("          weight: 2"))
    assert [(s.name, s.weight) for s in load_config("kthena").scores] == [("prefix-cache", 2)]


def test_named_kthena_config_is_the_kthena_helm_chart_default() -> None:
    config = load_config("kthena")
    assert config.filters == ("least-request",)
    assert [(s.name, s.weight) for s in config.scores] == [
        ("least-request", 1),
        ("gpu-usage", 1),
        ("least-latency", 1),
        ("prefix-cache", 1),
    ]
    assert config.plugin_args == {
        "least-request": {"maxWaitingRequests": 10},
        "least-latency": {"TTFTTPOTWeightFactor": 0.5},
        "prefix-cache": {
            "blockSizeToHash": 64,
            "maxBlocksToMatch": 128,
            "maxHashCacheSize": 50000,
            "topKMatches": 5,
        },
    }
    scheduler = build_scheduler(config, CollectorRegistry())
    least_request, gpu, latency, prefix = (ws.scorer for ws in scheduler.scorers)
    assert isinstance(least_request, LeastRequest) and least_request.args == LeastRequestArgs()
    assert scheduler.filters == (least_request,)  # one instance in both roles
    assert isinstance(gpu, GPUCacheUsage)
    assert isinstance(latency, LeastLatency) and latency.args == LeastLatencyArgs()
    assert isinstance(prefix, PrefixCacheScorer) and prefix.args == PrefixCacheArgs()
    assert scheduler.recorders == (prefix,) and scheduler.listeners == (prefix,)


def test_plugins_share_the_given_in_flight_counters() -> None:
    in_flight = InFlight()
    text = (
        "scheduler:\n  plugins:\n    Score:\n      enabled:\n"
        "        - {name: least-request, weight: 1}\n        - {name: cost-aware, weight: 1}\n"
    )
    scheduler = build_scheduler(parse_config(text, "cm.yaml"), CollectorRegistry(), in_flight)
    least_request, cost = (ws.scorer for ws in scheduler.scorers)
    assert isinstance(least_request, LeastRequest) and least_request.in_flight is in_flight
    assert isinstance(cost, CostAware) and cost.in_flight is in_flight


def test_loads_from_a_file_with_weight_and_args(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        weight_config("          weight: 2")
        + "  pluginConfig:\n  - name: prefix-cache\n    args: {topKMatches: 3}\n"
    )
    scheduler = build_scheduler(load_config(path), CollectorRegistry())
    assert scheduler.scorers[0].weight == 2
    assert scheduler.scorers[0].scorer.args.topKMatches == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("line", "got"),
    [
        pytest.param("          weight: 0", "got 0", id="zero"),
        pytest.param("          weight: -2", "got -2", id="negative"),
        pytest.param("", "got 0", id="missing"),
    ],
)
def test_weight_must_be_positive(line: str, got: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(weight_config(line), "cm.yaml")
    assert str(info.value) == (
        "cm.yaml: failed to Load Scheduler: failed to Unmarshal Plugins: "
        f'score plugin "prefix-cache" must set a weight greater than 0, {got}'
    )


def test_non_integer_weight_is_refused() -> None:
    with pytest.raises(ConfigError, match='score plugin "prefix-cache" weight must be an integer'):
        parse_config(weight_config("          weight: heavy"), "cm.yaml")


def test_score_disabled_has_no_effect() -> None:
    text = weight_config("          weight: 1") + "      disabled:\n        - name: prefix-cache\n"
    config = parse_config(text, "cm.yaml")
    assert [s.name for s in config.scores] == ["prefix-cache"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("scheduler: [\n", "cm.yaml: invalid YAML", id="unreadable-yaml"),
        pytest.param(
            "other: 1\n",
            "cm.yaml: expected a mapping with a 'scheduler' section",
            id="no-scheduler",
        ),
        pytest.param(
            "scheduler:\n  plugins:\n    Score:\n      enabled:\n"
            "        - {name: least-request, weight: 0}\n",
            "cm.yaml: failed to Load Scheduler: failed to Unmarshal Plugins: "
            'score plugin "least-request" must set a weight greater than 0, got 0',
            id="least-request-weight-zero",
        ),
        pytest.param(
            "scheduler:\n  plugins:\n    Score:\n      enabled: prefix-cache\n",
            "cm.yaml: scheduler.Score.enabled must be a list",
            id="enabled-not-list",
        ),
        pytest.param(
            "scheduler:\n  plugins:\n    Score:\n      enabled: [prefix-cache]\n",
            "cm.yaml: scheduler.plugins.Score.enabled[0]: expected a mapping",
            id="score-entry-not-mapping",
        ),
        pytest.param(
            "scheduler:\n  pluginConfig:\n  - args: {}\n",
            "cm.yaml: scheduler.pluginConfig[0]: each entry needs a 'name'",
            id="plugin-config-without-name",
        ),
    ],
)
def test_bad_configs_stop_start_up_naming_file_and_problem(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_scheduler(parse_config(text, "cm.yaml"), CollectorRegistry())
    assert str(info.value).startswith(message)


# Kthena's factory.go: a name its registry has no builder for, at that extension point,
# is logged "Failed to get plugin NAME." and skipped; start-up goes on.
@pytest.mark.parametrize(
    ("filters", "scores", "kept_filters", "kept_scores", "skipped"),
    [
        pytest.param([], ["prefix-cahce"], [], [], ["prefix-cahce"], id="typo"),
        pytest.param(["no-such-filter"], [], [], [], ["no-such-filter"], id="unknown-filter"),
        *(
            pytest.param([name], [], [], [], [name], id=f"{name}-is-no-filter")
            for name in (
                "prefix-cache",
                "gpu-usage",
                "least-latency",
                "cost-aware",
                "random",
                "kvcache-aware",
            )
        ),
    ],
)
def test_unknown_plugins_are_logged_and_skipped(
    filters: list[str],
    scores: list[str],
    kept_filters: list[str],
    kept_scores: list[str],
    skipped: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    text = (
        "scheduler:\n  plugins:\n    Filter:\n      enabled: ["
        + ", ".join(filters)
        + "]\n    Score:\n      enabled:\n"
        + "".join(f"        - {{name: {n}, weight: 1}}\n" for n in scores)
    )
    with caplog.at_level("ERROR", logger="extproc.scheduling.config"):
        scheduler = build_scheduler(parse_config(text, "cm.yaml"), CollectorRegistry())
    assert [f.type_name for f in scheduler.filters] == kept_filters
    assert [ws.scorer.type_name for ws in scheduler.scorers] == kept_scores
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert logged == [f"Failed to get plugin {name}." for name in skipped]


def test_a_score_plugin_listed_twice_is_configured_once_with_the_last_weight() -> None:
    """Kthena's scorePluginMap[name] = weight: the last entry wins, scored once."""
    text = (
        "scheduler:\n  plugins:\n    Filter:\n      enabled: [least-request, least-request]\n"
        "    Score:\n      enabled:\n"
        "        - {name: prefix-cache, weight: 1}\n"
        "        - {name: gpu-usage, weight: 1}\n"
        "        - {name: prefix-cache, weight: 3}\n"
    )
    scheduler = build_scheduler(parse_config(text, "cm.yaml"), CollectorRegistry())
    assert [(ws.scorer.type_name, ws.weight) for ws in scheduler.scorers] == [
        ("gpu-usage", 1),
        ("prefix-cache", 3),
    ]
    assert [f.type_name for f in scheduler.filters] == ["least-request"]
    pods = [make_pod("a"), make_pod("b")]
    scheduler.record(make_cycle("x" * 200), pods[0].id)
    assert scheduler.schedule(make_cycle("x" * 200), pods)[0] == pods[0]


def test_plugin_config_listed_twice_gives_the_last_args() -> None:
    text = (
        "scheduler:\n  pluginConfig:\n"
        "  - {name: prefix-cache, args: {topKMatches: 2}}\n"
        "  - {name: prefix-cache, args: {topKMatches: 7}}\n"
    )
    assert parse_config(text, "cm.yaml").plugin_args["prefix-cache"] == {"topKMatches": 7}


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: configuration file not found"):
        load_config(tmp_path / "nope.yaml")


def test_unparseable_args_use_defaults_and_log(caplog: pytest.LogCaptureFixture) -> None:
    text = weight_config("          weight: 1") + (
        "  pluginConfig:\n  - name: prefix-cache\n    args:\n      blockSizeToHash: big\n"
    )
    with caplog.at_level("WARNING"):
        scheduler = build_scheduler(parse_config(text, "cm.yaml"), CollectorRegistry())
    assert scheduler.scorers[0].scorer.args == PrefixCacheArgs()  # type: ignore[attr-defined]
    assert "Failed to unmarshal PrefixCacheArgs, using default values" in caplog.text
