"""bench.report.merged: a run of one pod set keeps the other pod sets' sections of the
results file, each with the command and configuration of the run that made it."""

from __future__ import annotations

from typing import Any

from bench.report import merged


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
