"""bench.routing_quality.aggregate's verdict of an extproc row (issue 35): a win needs the
best peer's hit ratio, a p99 no worse than the best peer's and than round robin's
(envoy-rr's, when it ran), and no failed request; bench.report's table shows round
robin's p99 on every row of its workload."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.report import COLUMNS, table
from bench.routing_quality import aggregate
from tests.bench.rows import run_row

PEER = run_row("sglang-router", hit_ratio=0.7, ttft_p99_ms=60.0)


@pytest.mark.parametrize(
    ("extproc", "rr_p99", "verdict"),
    [
        ({}, 55.0, "win (hit >= 0.700, p99 <= 60, p99 <= rr 55)"),
        ({}, 50.0, "win (hit >= 0.700, p99 <= 60, p99 <= rr 50)"),  # equal p99s win
        ({}, 40.0, "loss (hit >= 0.700, p99 <= 60, p99 > rr 40)"),  # beats the peers, not RR
        ({"ttft_p99_ms": 65.0}, 70.0, "loss (hit >= 0.700, p99 > 60, p99 <= rr 70)"),
        ({"hit_ratio": 0.69}, 55.0, "loss (hit < 0.700, p99 <= 60, p99 <= rr 55)"),
        ({"failed": 1}, 55.0, "loss (hit >= 0.700, p99 <= 60, p99 <= rr 55)"),
        ({}, None, "win (hit >= 0.700, p99 <= 60)"),  # envoy-rr did not run
    ],
)
def test_an_extproc_row_wins_only_against_the_peers_and_round_robin(
    extproc: dict[str, Any], rr_p99: float | None, verdict: str
) -> None:
    runs = [run_row("extproc-default", **({"ttft_p99_ms": 50.0} | extproc)), PEER]
    if rr_p99 is not None:
        runs.append(run_row("envoy-rr", hit_ratio=0.5, ttft_p99_ms=rr_p99))
    rows = {r["contender"]: r for r in aggregate(runs)}
    assert rows["extproc-default"]["verdict"] == verdict
    assert "verdict" not in rows["envoy-rr" if rr_p99 is not None else "sglang-router"]


def test_round_robin_of_another_workload_does_not_count() -> None:
    rows = aggregate([
        run_row("extproc-default", ttft_p99_ms=50.0), PEER,
        run_row("envoy-rr", workload="other", ttft_p99_ms=10.0),
    ])  # fmt: skip
    assert rows[0]["verdict"] == "win (hit >= 0.700, p99 <= 60)"


def test_without_a_peer_there_is_no_verdict_even_with_round_robin() -> None:
    rows = aggregate([run_row("extproc-default"), run_row("envoy-rr", ttft_p99_ms=90.0)])
    assert "verdict" not in rows[0]


def rr_cells(rows: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """The "RR p99 ms" cell of each (workload, contender) in the table."""
    column = COLUMNS.index("RR p99 ms")
    assert COLUMNS[column - 1] == "TTFT p99 ms"
    cells = [line.strip("| ").split(" | ") for line in table(rows).splitlines()[2:]]
    return {(c[0], c[1]): c[column] for c in cells}


def test_every_row_shows_round_robins_p99_of_its_workload() -> None:
    rows = aggregate([
        run_row("extproc-default", workload="chat", ttft_p99_ms=50.0),
        run_row("envoy-rr", workload="chat", rep=0, ttft_p99_ms=40.0),
        run_row("envoy-rr", workload="chat", rep=1, ttft_p99_ms=44.0),
        run_row("envoy-rr", workload="chat", rep=2, ttft_p99_ms=90.0),
        run_row("extproc-default", workload="trace", ttft_p99_ms=30.0),
    ])  # fmt: skip
    assert rr_cells(rows) == {
        ("chat", "extproc-default"): "44",  # the median of envoy-rr's repetitions
        ("chat", "envoy-rr"): "44",
        ("trace", "extproc-default"): "",  # envoy-rr did not run it
    }


def test_rows_recorded_before_the_column_render_it_from_the_rows() -> None:
    old = json.loads(json.dumps(aggregate([run_row("envoy-rr", ttft_p99_ms=31.0),
                                           run_row("extproc-default")])))  # fmt: skip
    assert rr_cells(old) == {("chat", "envoy-rr"): "31", ("chat", "extproc-default"): "31"}


@pytest.mark.parametrize(
    ("loads", "verdict"),
    [
        (30, "win (hit >= 0.700, p99 <= 60, loads <= 40)"),
        (40, "win (hit >= 0.700, p99 <= 60, loads <= 40)"),
        (41, "loss (hit >= 0.700, p99 <= 60, loads > 40)"),
    ],
)
def test_on_the_lora_workload_a_win_also_needs_the_fewest_adapter_loads(
    loads: int, verdict: str
) -> None:
    runs = [
        run_row("extproc-default", ttft_p99_ms=50.0, adapter_loads=loads),
        run_row("sglang-router", hit_ratio=0.7, ttft_p99_ms=60.0, adapter_loads=40),
        run_row("vllm-router", hit_ratio=0.6, ttft_p99_ms=70.0, adapter_loads=90),
    ]
    rows = {r["contender"]: r for r in aggregate(runs)}
    assert rows["extproc-default"]["verdict"] == verdict
    assert f"| {loads} |" in table(list(rows.values()))
