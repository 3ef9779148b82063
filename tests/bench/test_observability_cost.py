"""bench.observability_cost: both routers see the same messages; the table's figures."""

from __future__ import annotations

from bench.observability_cost import body_message, handlers, log_message, markdown
from extproc.routing.outcome_metrics import OutcomeMetrics
from testkit.factories import make_pod


def test_the_default_router_counts_each_end_and_the_bare_one_has_no_observer() -> None:
    pods = [make_pod(f"p{i}", port=8000 + i) for i in range(2)]
    bare, default = handlers(pods, False), handlers(pods, True)
    assert not bare[0].router.observers and default[0].router.observers
    for route, access_log in (bare, default):
        route.process(body_message(0, 100))
        access_log.complete(log_message(0, pods[0].address))
    (observer,) = default[0].router.observers
    assert isinstance(observer, OutcomeMetrics)
    counts = [
        s.value
        for family in observer.collect()
        for s in family.samples
        if s.name == "extproc_request_duration_seconds_count"
    ]
    assert counts == [1]


def test_the_table_gives_the_added_cpu_per_prompt_size() -> None:
    rows = [{"prompt_kb": 8, "bare_us": 300.0, "default_us": 325.0, "added_us": 24.5}]
    info = {"cpu_model": "cpu", "cores": 2, "git_sha": "abcdef123456789"}
    assert "| 8 KB | 300 | 325 | +24.5 |" in markdown(rows, info, 10).splitlines()
