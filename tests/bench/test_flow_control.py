"""bench.flow_control's pure parts (issue 30): the schedule of arrivals, Jain's index,
goodput, refusals, time queued from extproc's histogram, the verdicts and the report."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from bench.flow_client import FlowOutcome
from bench.flow_control import (
    FLOW_SECTION,
    Saturation,
    expand,
    flow_sections,
    run_all,
)
from bench.flow_metrics import (
    bucket_bound,
    class_summary,
    flow_samples,
    goodput_tokens,
    jain,
    percentile,
    queued_by_class,
    run_summary,
    sample_delta,
    verdicts,
)
from bench.flow_report import write
from bench.flow_workload import (
    CLASS_TENANT,
    FAIRNESS_HEADER,
    NOISY_TENANT,
    OBJECTIVE_HEADER,
    Mix,
    arrivals,
)
from extproc.routing.flow.config import parse_flow_control

TENANTS = list(Mix().tenant_weights())


def served_outcome(
    tenant: str = "tenant-1", ttft_s: float = 0.1, tokens: int = 10, cls: str = "standard",
    at_s: float = 0.0, e2e_s: float = 1.0,
) -> FlowOutcome:  # fmt: skip
    return FlowOutcome(cls, tenant, at_s, 200, ttft_s, e2e_s, tokens)


def refused(status: int = 429, cls: str = "standard", retry_after: str | None = "1") -> FlowOutcome:
    return FlowOutcome(cls, "tenant-1", 0.0, status, None, 0.01, 0, retry_after, f"http {status}")


# --- the schedule of arrivals ---


def test_arrivals_are_poisson_at_the_rate_bounded_in_time_and_count() -> None:
    reqs = arrivals(Mix(), rate=50.0, duration_s=40.0, max_requests=10_000, seed=7)
    assert 1800 < len(reqs) < 2200  # 2,000 expected, sd ~45
    assert all(0 < r.at_s < 40.0 for r in reqs)
    assert [r.at_s for r in reqs] == sorted(r.at_s for r in reqs)
    gaps = [b.at_s - a.at_s for a, b in pairwise(reqs)]
    assert statistics_cv(gaps) == pytest.approx(1.0, abs=0.1)  # exponential gaps: cv 1
    assert len(arrivals(Mix(), rate=50.0, duration_s=40.0, max_requests=100)) == 100


def statistics_cv(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean


def test_classes_and_tenants_follow_the_shares_and_the_noisy_tenant_sends_5x() -> None:
    reqs = arrivals(Mix(), rate=100.0, duration_s=100.0, max_requests=20_000, seed=3)
    classes = Counter(r.cls for r in reqs)
    for cls, share in zip(("critical", "standard", "sheddable"), Mix().shares, strict=True):
        assert classes[cls] / len(reqs) == pytest.approx(share, abs=0.02)
    tenants = Counter(r.tenant for r in reqs if r.cls == "standard")
    assert set(tenants) == set(TENANTS) and len(TENANTS) == 5
    others = [tenants[t] for t in TENANTS if t != NOISY_TENANT]
    assert tenants[NOISY_TENANT] / (sum(others) / len(others)) == pytest.approx(5.0, rel=0.1)
    for r in reqs:
        if r.cls != "standard":
            assert r.tenant == CLASS_TENANT[r.cls]
        assert r.headers == {OBJECTIVE_HEADER: r.cls, FAIRNESS_HEADER: r.tenant}


def test_schedules_are_deterministic_and_share_no_prompt_across_seeds() -> None:
    mix = Mix(prompt_tokens=64, output_tokens=8)
    a = arrivals(mix, rate=20.0, duration_s=10.0, max_requests=500, seed=2)
    assert a == arrivals(mix, rate=20.0, duration_s=10.0, max_requests=500, seed=2)
    b = arrivals(mix, rate=20.0, duration_s=10.0, max_requests=500, seed=3)
    prompts = [r.body["prompt"] for r in a]
    assert len(set(prompts)) == len(prompts)
    assert not set(prompts) & {r.body["prompt"] for r in b}
    assert all(
        len(p) == 64 * 4 and r.body["max_tokens"] == 8 for p, r in zip(prompts, a, strict=True)
    )


def test_a_rate_or_duration_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        arrivals(Mix(), rate=0.0, duration_s=1.0, max_requests=10)


# --- figures ---


def test_jain_index() -> None:
    assert jain([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain([1.0, 1.0, 1.0, 1.0, 5.0]) == pytest.approx(81 / (5 * 29))
    assert math.isnan(jain([0.0, 0.0]))


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 0.5) == 50.0
    assert percentile([7.0], 0.99) == 7.0
    assert math.isnan(percentile([], 0.5))


def test_goodput_counts_only_served_requests_within_the_slo() -> None:
    outcomes = [
        served_outcome(ttft_s=0.5, tokens=10),  # at the SLO: counts
        served_outcome(ttft_s=0.51, tokens=100),  # late
        refused(),
        FlowOutcome("standard", "tenant-1", 0.0, 200, 0.1, 1.0, 1000, None, "ReadError"),  # broken
    ]
    assert goodput_tokens(outcomes, slo_s=0.5) == 10
    summary = class_summary(outcomes, duration_s=10.0, slo_s=0.5)
    assert summary["goodput_tok_s"] == 1.0
    assert summary["served_tok_s"] == 11.0


def test_refusals_are_counted_by_status_apart_from_failures() -> None:
    outcomes = [refused(429), refused(429, retry_after=None), refused(408, retry_after=None),
                refused(500, retry_after=None), served_outcome(ttft_s=0.2), served_outcome(ttft_s=0.4)]  # fmt: skip
    s = class_summary(outcomes, duration_s=1.0, slo_s=1.0)
    assert (s["sent"], s["served"], s["refused"], s["failed"]) == (6, 2, 3, 1)
    assert s["refused_by_status"] == {"429": 2, "408": 1}
    assert s["refused_with_retry_after"] == 1
    assert s["errors"] == ["http 500"]
    assert (s["ttft_p50_ms"], s["ttft_p99_ms"]) == pytest.approx((200.0, 400.0))


def test_fairness_counts_standard_tokens_served_while_the_schedule_lasts() -> None:
    outcomes = [
        served_outcome("tenant-0", tokens=10, at_s=1.0, e2e_s=2.0),
        served_outcome("tenant-0", tokens=50, at_s=9.0, e2e_s=2.0),  # ends after the schedule
        served_outcome(
            "tenant-1", tokens=10, at_s=1.0, e2e_s=2.0, ttft_s=5.0
        ),  # late, still served
        served_outcome("critical-app", tokens=99, cls="critical"),  # another band
    ]
    run = run_summary(outcomes, duration_s=10.0, slo_s=1.0, tenants=TENANTS)
    assert run["tenant_tokens"] == {"tenant-0": 10, "tenant-1": 10, "tenant-2": 0,
                                    "tenant-3": 0, "tenant-4": 0}  # fmt: skip
    assert run["jain"] == pytest.approx(jain([10, 10, 0, 0, 0]))
    assert run["tenant_tokens_all"]["tenant-0"] == 60
    assert run["jain_all"] == pytest.approx(jain([60, 10, 0, 0, 0]))
    assert run["jain_goodput"] == pytest.approx(jain([60, 0, 0, 0, 0]))
    assert run["classes"]["critical"]["served"] == 1 and run["all"]["sent"] == 4


# --- time queued from extproc's histogram ---

PAGE = """\
# HELP extproc_flow_queued_seconds Time requests spent queued.
# TYPE extproc_flow_queued_seconds histogram
extproc_flow_queued_seconds_bucket{le="0.1",outcome="dispatched",priority="100"} %(c1)s
extproc_flow_queued_seconds_bucket{le="1.0",outcome="dispatched",priority="100"} %(c2)s
extproc_flow_queued_seconds_bucket{le="+Inf",outcome="dispatched",priority="100"} %(c2)s
extproc_flow_queued_seconds_count{outcome="dispatched",priority="100"} %(c2)s
extproc_flow_queued_seconds_sum{outcome="dispatched",priority="100"} %(s)s
extproc_flow_queued_seconds_bucket{le="10.0",outcome="queue_timeout",priority="0"} 0
extproc_flow_queued_seconds_bucket{le="30.0",outcome="queue_timeout",priority="0"} 4
extproc_flow_queued_seconds_bucket{le="+Inf",outcome="queue_timeout",priority="0"} 4
extproc_flow_queued_seconds_count{outcome="queue_timeout",priority="0"} 4
extproc_flow_queued_seconds_sum{outcome="queue_timeout",priority="0"} 60
extproc_flow_queued_seconds_bucket{le="10.0",outcome="dispatched",priority="0"} 2
extproc_flow_queued_seconds_bucket{le="30.0",outcome="dispatched",priority="0"} 2
extproc_flow_queued_seconds_bucket{le="+Inf",outcome="dispatched",priority="0"} 2
extproc_flow_queued_seconds_count{outcome="dispatched",priority="0"} 2
extproc_flow_queued_seconds_sum{outcome="dispatched",priority="0"} 4
# TYPE extproc_flow_refused counter
extproc_flow_refused_total{priority="0",reason="queue_timeout"} 4
extproc_flow_refused_total{priority="-1",reason="shed"} %(shed)s
# TYPE extproc_flow_dispatched counter
extproc_flow_dispatched_total{priority="0",reason="capacity"} 3
"""


def page(c1: int, c2: int, s: float, shed: int) -> str:
    return PAGE % {"c1": c1, "c2": c2, "s": s, "shed": shed}


def test_the_bucket_bound_is_the_upper_bound_holding_the_rank() -> None:
    buckets = {0.1: 10.0, 1.0: 20.0, math.inf: 20.0}
    assert bucket_bound(buckets, 0.5) == 0.1
    assert bucket_bound(buckets, 0.51) == 1.0
    assert bucket_bound(buckets, 0.99) == 1.0
    assert bucket_bound({0.1: 1.0, math.inf: 4.0}, 0.99) == math.inf
    assert math.isnan(bucket_bound({0.1: 0.0, math.inf: 0.0}, 0.5))
    assert math.isnan(bucket_bound({}, 0.5))


def test_time_queued_and_refusals_per_class_are_counted_between_two_scrapes() -> None:
    before = flow_samples(page(c1=5, c2=5, s=0.5, shed=7))
    after = flow_samples(page(c1=15, c2=25, s=4.5, shed=10))
    queued = queued_by_class(sample_delta(after, before))
    crit = queued["critical"]
    assert (crit["queued"], crit["mean_s"], crit["p99_bound_s"]) == (20, pytest.approx(0.2), 1.0)
    assert crit["refused_by_reason"] == {}
    assert queued["standard"]["queued"] == 0  # the same on both pages
    assert queued["sheddable"]["refused_by_reason"] == {"shed": 3}
    alone = queued_by_class(after)  # outcomes summed: 4 timed out, 2 dispatched
    assert alone["standard"]["queued"] == 6 and alone["standard"]["mean_s"] == pytest.approx(64 / 6)
    assert alone["standard"]["p99_bound_s"] == 30.0
    assert alone["standard"]["refused_by_reason"] == {"queue_timeout": 4}
    assert math.isnan(queued["sheddable"]["mean_s"])


# --- verdicts ---


def summary(crit_p99: float = 150.0, crit_refused: int = 0, fairness: float = 0.95,
            goodput: float = 100.0, all_p99: float = 100.0) -> dict[str, Any]:  # fmt: skip
    return {"classes": {"critical": {"ttft_p99_ms": crit_p99, "refused": crit_refused}},
            "all": {"ttft_p99_ms": all_p99, "goodput_tok_s": goodput}, "jain": fairness}  # fmt: skip


def test_every_goal_passes_at_its_limit() -> None:
    v = verdicts(summary(), summary(), reference_goodput=100.0)
    assert {k: (g["value"], g["limit"], g["pass"]) for k, g in v.items()} == {
        "critical_ttft": (150.0, 150.0, True),
        "critical_not_refused": (0, 0, True),
        "fairness": (0.95, 0.9, True),
        "goodput": (100.0, 100.0, True),
    }


@pytest.mark.parametrize(
    ("overload", "goal"),
    [
        (summary(crit_p99=151.0), "critical_ttft"),
        (summary(crit_p99=math.nan), "critical_ttft"),  # no critical request served
        (summary(crit_refused=1), "critical_not_refused"),
        (summary(fairness=0.89), "fairness"),
        (summary(fairness=math.nan), "fairness"),
        (summary(goodput=99.0), "goodput"),
    ],
)
def test_each_goal_fails_past_its_limit(overload: dict[str, Any], goal: str) -> None:
    v = verdicts(overload, summary(), reference_goodput=100.0)
    assert [k for k, g in v.items() if not g["pass"]] == [goal]


def test_the_critical_limit_is_the_baseline_p99_of_every_class() -> None:
    v = verdicts(summary(crit_p99=290.0), summary(crit_p99=50.0, all_p99=200.0), None)
    assert v["critical_ttft"]["limit"] == 300.0 and v["critical_ttft"]["pass"]
    assert "goodput" not in v  # extproc-off did not run


def test_the_critical_limit_is_extproc_offs_unloaded_p99_when_lower() -> None:
    """A reserve holds the standard band at an unloaded run's bursts: the contender's own
    unloaded p99 is then higher than the pods', and must not loosen its limit."""
    slower = summary(all_p99=280.0)
    v = verdicts(summary(crit_p99=140.0), slower, 100.0, reference_baseline_p99=90.0)
    assert v["critical_ttft"]["limit"] == 135.0 and not v["critical_ttft"]["pass"]
    v = verdicts(summary(crit_p99=140.0), summary(all_p99=60.0), 100.0, 90.0)
    assert v["critical_ttft"]["limit"] == 90.0  # its own, when lower


def test_run_all_judges_every_contender_against_extproc_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Goodput is held to extproc-off's, whatever the order the contenders ran in."""
    import bench.flow_control as fc

    goodputs = {"extproc-flow": 120.0, "extproc-off": 100.0, "sglang-router": 80.0}

    def stub(name: str) -> fc.Serve:
        @contextmanager
        def serve(pods: object, log_dir: Path) -> Iterator[fc.Served]:
            yield fc.Served(name)  # the URL names the contender

        return serve

    def phase(served: fc.Served, *_: object) -> dict[str, Any]:
        run = run_summary([served_outcome()], duration_s=1.0, slo_s=1.0, tenants=TENANTS)
        run["all"]["goodput_tok_s"] = goodputs[served.url]
        return run

    monkeypatch.setattr(fc, "run_phase", phase)
    monkeypatch.setattr(fc, "wait_idle", lambda pods: None)
    pods = SimpleNamespace(reset_all=lambda: None)
    args = SimpleNamespace(contenders=list(goodputs), mix=Mix())
    schedules: dict[str, tuple[list[Any], float]] = {"baseline": ([], 1.0), "overload": ([], 1.0)}
    runs = run_all(pods, {n: stub(n) for n in goodputs}, schedules, args, Path())  # type: ignore[arg-type]
    judged = {
        n: r["verdicts"]["goodput"]["pass"] for n, r in runs.items() if "goodput" in r["verdicts"]
    }
    assert judged == {"extproc-flow": True, "sglang-router": False}  # not extproc-off itself


# --- configuration of the contenders ---


def test_the_flow_section_parses_and_the_variants_override_its_saturation() -> None:
    one = flow_sections(FLOW_SECTION, [])
    assert list(one) == ["extproc-flow"]
    config = parse_flow_control(yaml.safe_load(one["extproc-flow"])["flowControl"], "test")
    assert config.enabled and config.objectives == {"critical": 100, "standard": 0,
                                                    "sheddable": -1}  # fmt: skip
    assert config.trusted_headers == {OBJECTIVE_HEADER, FAIRNESS_HEADER}
    variants = [Saturation.parse(v) for v in ("5", "0.5r2", "0r4s8")]
    several = flow_sections(FLOW_SECTION, variants)
    assert list(several) == ["extproc-flow-w5", "extproc-flow-w0.5-r2", "extproc-flow-w0-r4-s8"]
    limits = [parse_flow_control(yaml.safe_load(s)["flowControl"], "t") for s in several.values()]
    assert [(c.max_waiting, c.reserved_slots, c.batch_slots) for c in limits] == [
        (5, 0, None), (0.5, 2, None), (0, 4, 8)]  # fmt: skip
    assert limits[1].reserved_for == 100
    with pytest.raises(ValueError, match="expected W, WrR"):
        Saturation.parse("0x4")
    assert expand(["extproc-flow", "sglang-router"], several) == [*several, "sglang-router"]


# --- the report ---


def test_the_report_has_a_verdict_per_goal_and_the_chart(tmp_path: Path) -> None:
    outcomes = [served_outcome("tenant-0", at_s=1.0), served_outcome("tenant-1", at_s=1.0),
                served_outcome("critical-app", cls="critical"), refused(429, cls="sheddable")]  # fmt: skip
    run = run_summary(outcomes, duration_s=10.0, slo_s=1.0, tenants=TENANTS)
    run["queued"] = queued_by_class(flow_samples(page(c1=1, c2=4, s=2.0, shed=2)))
    results = {
        "command": "python -m bench.flow_control", "utc": "now", "setup": "setup",
        "capacity_req_s": 10.0, "baseline_factor": 0.5, "overload_factor": 2.0,
        "slo_ttft_s": 1.0, "flow_sections": {"extproc-flow": "flowControl: {}\n"},
        "contenders": {"extproc-flow": {"baseline": run, "overload": run,
                                        "verdicts": verdicts(run, run, 40.0)}},
    }  # fmt: skip
    text = write(results, tmp_path, "notes").read_text()
    assert (tmp_path / "flow_control.png").stat().st_size > 1000
    assert text.count("| extproc-flow |") == 4 + 8 + 1  # verdicts, classes x loads, fairness
    assert "| no critical request refused | 0 | 0 | pass |" in text
    assert "| 1 (429: 1; 1) |" in text
    assert "| 10 (10) | 10 (10) | 0 (0) |" in text
    assert "| 4 (mean 0.50, p99 <= 1) |" in text  # critical
    assert "| 6 (mean 10.67, p99 <= 30); refused: queue_timeout 4 |" in text  # standard
    assert "| 0; refused: shed 2 |" in text  # sheddable
