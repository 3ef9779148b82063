"""``extproc simulate``: the table, a repeatable JSON report, the chart, and flag errors."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from extproc.cli import main

SMALL = ["simulate", "--workload", "burst", "--requests", "80", "--pods", "3"]


def run(tmp_path: Path, tag: str, *extra: str) -> bytes:
    out = tmp_path / f"{tag}.json"
    assert main([*SMALL, "--json", str(out), *extra]) == 0
    return out.read_bytes()


def test_same_seed_same_json_other_seed_other_json(tmp_path: Path) -> None:
    first, again = run(tmp_path, "a", "--seed", "3"), run(tmp_path, "b", "--seed", "3")
    assert first == again
    assert run(tmp_path, "c", "--seed", "4") != first


def test_report_holds_the_configuration_and_every_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "chart.png"
    doc = orjson.loads(
        run(
            tmp_path,
            "r",
            "--png",
            str(png),
            "--num-gpu-blocks",
            "500",
            "--policies",
            "round-robin,cost-aware",
        )
    )
    config = doc["config"]
    assert config["engine"]["num_gpu_blocks"] == 500  # the flag beats the workload's 384
    assert config["engine"]["block_size"] == 16
    assert config["workload"]["num_requests"] == 80
    assert "estimated-ttft" in config["scheduler_config"]["text"]  # the embedded default
    assert list(doc["policies"]) == ["cost-aware", "round-robin"]  # sorted keys
    rr = doc["policies"]["round-robin"]
    assert [p["num_requests"] for p in rr["pods"]] == [27, 27, 26]
    assert 0.0 < rr["hit_ratio"] < 1.0
    assert rr["ttft_s"]["p50"] <= rr["ttft_s"]["p99"] <= rr["ttft_s"]["max"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "round-robin" in table and "cost-aware" in table and "hit" in table


@pytest.mark.parametrize(
    ("workload", "shape"),
    [
        pytest.param("multiturn", {"num_system_prompts": 1, "system_tokens": 200}, id="multiturn"),
        pytest.param("tenants", {"num_tenants": 8, "system_tokens": 600}, id="tenants"),
    ],
)
def test_benchmark_shaped_workloads_take_the_benchmarks_pods(
    tmp_path: Path, workload: str, shape: dict[str, int]
) -> None:
    out = tmp_path / "w.json"
    argv = ["simulate", "--workload", workload, "--requests", "30", "--pods", "2"]
    assert main([*argv, "--policies", "round-robin", "--json", str(out)]) == 0
    config = orjson.loads(out.read_bytes())["config"]
    assert config["workload"]["name"] == workload and config["workload"]["num_requests"] == 30
    assert shape.items() <= config["workload"].items()
    assert (config["engine"]["num_gpu_blocks"], config["engine"]["max_num_seqs"]) == (2048, 8)


def test_a_custom_scheduler_config_is_used_and_recorded(tmp_path: Path) -> None:
    config = tmp_path / "sched.yaml"
    config.write_text(
        "scheduler:\n  plugins:\n    Score:\n      enabled:\n        - {name: prefix-cache, weight: 3}\n"
        "  pluginConfig:\n    - {name: prefix-cache, args: {topKMatches: 1}}\n"
    )
    doc = orjson.loads(run(tmp_path, "c", "--config", str(config), "--policies", "prefix-cache"))
    assert doc["config"]["scheduler_config"]["source"] == str(config)
    assert "topKMatches: 1" in doc["config"]["scheduler_config"]["text"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--policies", "random"], "unknown ['random']", id="policy"),
        pytest.param(["--workload", "trace"], "needs --trace FILE", id="no-trace"),
        pytest.param(
            ["--workload", "trace", "--trace", "/nonexistent.jsonl"], "not found", id="missing"
        ),
        pytest.param(["--pods", "0"], "num_pods must be > 0", id="pods"),
        pytest.param(["--num-gpu-blocks", "0"], "EngineConfig.num_gpu_blocks", id="engine"),
        pytest.param(["--config", "/nonexistent.yaml"], "cannot read", id="config"),
    ],
)
def test_bad_flags_exit_2_with_a_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *args]) == 2
    assert message in capsys.readouterr().err
