"""bench.report.merged: a run of one pod set keeps the other pod sets' sections of the
results file, each with the command and configuration of the run that made it."""

from __future__ import annotations

from typing import Any

from bench.replay import Outcome
from bench.report import merged
from bench.routing_quality import slowest


def section(rows: str, command: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"title": rows, "setup": "", "rows": rows}
    if command is not None:
        out |= {"command": command, "config_json": "{}", "utc": "then"}
    return out


def test_a_run_replaces_its_own_pod_set_and_keeps_the_others() -> None:
    old = {"runs": {"vllm": section("old vllm", "run 1"), "sim": section("old sim", "run 1")}}
    new = {"runs": {"sim": section("new sim", "run 2")}}
    runs = merged(new, old)["runs"]
    assert list(runs) == ["sim", "vllm"]
    assert runs["sim"]["rows"] == "new sim" and runs["sim"]["command"] == "run 2"
    assert runs["vllm"]["rows"] == "old vllm" and runs["vllm"]["command"] == "run 1"


def test_sim_pods_with_events_are_a_section_of_their_own() -> None:
    old = {"runs": {"sim": section("sim", "run 1")}}
    runs = merged({"runs": {"sim-events": section("events", "run 2")}}, old)["runs"]
    assert list(runs) == ["sim", "sim-events"]


def test_the_earlier_layout_lends_its_command_to_each_kept_section() -> None:
    old = {"command": "run 0", "config_json": '{"repeat": 2}',
           "runs": {"vllm": section("old vllm")}}  # fmt: skip
    runs = merged({"runs": {"sim": section("new", "run 2")}}, old)["runs"]
    assert runs["vllm"]["command"] == "run 0"
    assert runs["vllm"]["config_json"] == '{"repeat": 2}'


def test_no_earlier_file() -> None:
    assert list(merged({"runs": {"vllm": section("v", "run")}}, None)["runs"]) == ["vllm"]


def test_slowest_lists_the_longest_ttfts_with_when_they_were_due() -> None:
    outcomes = [
        Outcome(True, ttft, 1.0, 4, at_s=at) for at, ttft in ((0.0, 0.02), (1.5, 0.9), (3.0, None))
    ] + [Outcome(True, 0.05, 1.0, 4, at_s=2.0), Outcome(True, 0.4, 1.0, 4, at_s=2.5)]
    assert slowest(outcomes, 2) == [
        {"at_s": 1.5, "ttft_ms": 900.0},
        {"at_s": 2.5, "ttft_ms": 400.0},
    ]
