"""bench.cost_model_gap: the configuration it compares with, and one measured replay."""

from __future__ import annotations

from bench.cost_model_gap import BEFORE, config_with, markdown, measure
from extproc.scheduling.config import default_config_text, parse_config
from extproc.sim.workloads import multiturn_workload


def test_config_with_sets_the_arguments_it_names_and_adds_the_missing() -> None:
    text = config_with(default_config_text(), {"prefillMsPerToken": "0.1", "extra": "3"})
    config = parse_config(text, "t")
    args = config.plugin_args["estimated-ttft"]
    assert args["prefillMsPerToken"] == 0.1 and args["extra"] == 3
    assert args["queuedMs"] == 30.0  # the others kept
    assert config.flow_control == {}  # the rest of the file too
    assert text.count("prefillMsPerToken") == 1


def test_a_replay_reports_each_gap() -> None:
    config = parse_config(config_with(default_config_text(), BEFORE), "before")
    row = measure(multiturn_workload(num_requests=40), config)
    assert row["requests"] == 40
    assert 0.0 < row["hit_ratio"] < 1.0
    # on an idle engine the estimate carries queuedMs (30 ms) for the request's own step
    assert row["wait_gap_ms_median"] < 0
    table = markdown({("multiturn", "before", "fresh"): row})
    assert table.splitlines()[2].startswith("| multiturn | before | fresh |")
