"""The Grafana dashboard: Grafana's dashboard schema, PromQL that parses, the panels asked for,
and series that the code emits.

The schema is the ``Dashboard`` type of the npm package @grafana/schema, generated into
grafana/dashboard.schema.json by grafana/generate.sh (Grafana itself is not installable
here). PromQL is parsed by ``promtool check rules`` from Debian's prometheus package.
"""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.errors import Overloaded
from extproc.routing.decision import RouteDecision
from extproc.routing.flow.config import FAIRNESS_HEADER, OBJECTIVE_HEADER, parse_flow_control
from extproc.routing.flow.held import Held
from extproc.routing.observe import EndTiming
from extproc.routing.outcome_metrics import OutcomeMetrics
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, default_config_text, parse_config
from extproc.scheduling.inflight import InFlight
from testkit.dashboard import DASHBOARD, PRECISE_ROW, panels, queries, require_binary
from testkit.factories import make_pod

SCHEMA = Path(__file__).parent / "grafana" / "dashboard.schema.json"
HIT_RATE_BUCKET = 'kthena_router_prefix_cache_match_ratio_bucket{le="0.0"}'
FLOW_ROW = "Flow control"  # most of its series appear only once a request was held
SERIES = re.compile(r"\b(?:kthena|extproc)_[a-z_]+")
REQUESTS_ROW = "Requests"
PREDICTED = "Predicted vs reported prefix-cache hit ratio"


def test_dashboard_matches_grafanas_schema() -> None:
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(
        jsonschema.Draft7Validator(schema).iter_errors(json.loads(DASHBOARD.read_text())),
        key=lambda e: list(e.absolute_path),
    )
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_every_query_parses_with_promtool(tmp_path: Path) -> None:
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": expr}
                    for i, expr in enumerate(queries().values())
                ],
            }
        ]
    }
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [require_binary("promtool"), "check", "rules", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_rows_and_prefix_cache_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == [
        "Prefix cache",
        "Scheduling",
        REQUESTS_ROW,
        "Errors",
        "Pod load",
        FLOW_ROW,
        PRECISE_ROW,
    ]
    titles = {p["title"] for p in panels(dashboard)}
    assert {
        "Prefix cache hit rate",
        "Prefix match ratio p50 / p90 / p99",
        "Prefix cache entries & eviction rate",
        "Scheduling latency p50 / p90 / p99",
        "Errors by status and code",
    } <= titles
    found = queries()
    # Hit rate: attempts with at least one matching block = all minus the le="0.0" bucket.
    assert HIT_RATE_BUCKET in found["Prefix cache hit rate/A"]
    assert [found[f"Prefix match ratio p50 / p90 / p99/{r}"][:24] for r in "ABC"] == [
        "histogram_quantile(0.5, ",
        "histogram_quantile(0.9, ",
        "histogram_quantile(0.99,",
    ]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))


def test_precise_row_is_collapsed_and_reads_every_precise_metric() -> None:
    """Folded away unless kvEvents is on; its panels cover what the metrics
    reference (docs/reference/metrics.md) lists for the precise plugin and the KV-events subscriber."""
    dashboard = json.loads(DASHBOARD.read_text())
    [row] = [p for p in dashboard["panels"] if p["title"] == PRECISE_ROW]
    assert row["collapsed"] is True and row["panels"]
    exprs = " ".join(t["expr"] for p in row["panels"] for t in p["targets"])
    precise = set(queries(rows=[PRECISE_ROW]))
    assert precise == {f"{p['title']}/{t['refId']}" for p in row["panels"] for t in p["targets"]}
    assert not precise & set(queries(except_rows=[PRECISE_ROW]))
    for name in (
        "extproc_precise_prefix_cache_match_ratio_bucket",
        "extproc_precise_prefix_tokenize_seconds_bucket",
        "extproc_precise_prefix_segments_total",
        "extproc_precise_prefix_fallbacks_total",
        "extproc_kv_events_received_total",
        "extproc_kv_events_applied_total",
        "extproc_kv_events_gaps_total",
        "extproc_kv_events_replays_total",
        "extproc_kv_events_restarts_total",
        "extproc_kv_events_stale_pods",
        "extproc_kv_events_marked_stale_total",
        "extproc_kv_events_errors_total",
        "extproc_kv_events_blocks",
        "extproc_kv_events_evicted_blocks_total",
        "extproc_kv_events_orphan_blocks_total",
    ):
        assert name in exprs, name


def row_series(title: str) -> set[str]:
    """The series names the panels of the (open) row ``title`` read."""
    dashboard = json.loads(DASHBOARD.read_text())
    names: set[str] = set()
    in_row = False
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            in_row = panel["title"] == title
        elif in_row:
            for target in panel["targets"]:
                names.update(SERIES.findall(target["expr"]))
    return names


def test_the_shipped_default_emits_every_series_the_prefix_cache_and_requests_rows_read() -> None:
    """The default configuration's /metrics (its registry, as ``serve`` exposes it, with
    the per-request outcomes observer), after hits, misses and evictions, has a sample of
    each series the prefix-cache and requests panels read."""
    text = default_config_text().replace("maxHashCacheSize: 50000", "maxHashCacheSize: 8")
    registry, in_flight = CollectorRegistry(), InFlight()
    scheduler = build_scheduler(parse_config(text, "default"), registry, in_flight)
    pods = [make_pod(f"p{i}", port=8000 + i) for i in range(2)]
    router = Router(scheduler, pods, in_flight=in_flight, registry=registry)
    router.observers.append(OutcomeMetrics(registry))
    timing = EndTiming(0.05, 0.5, 400, 2000, 200)
    for i in range(6):  # three prompts twice: misses, then hits; 5 blocks each, so evictions
        body = b'{"model": "m", "prompt": "%d%s"}' % (i % 3, b"x" * 300)
        decision = router.route("/v1/completions", body, request_id=f"r{i}")
        assert router.complete(f"r{i}", decision.pods[0].address, True, timing=timing)
    exposed = {
        sample.name
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    wanted = row_series("Prefix cache")
    assert {
        "kthena_router_prefix_cache_match_ratio_bucket",
        "kthena_router_prefix_cache_entries",
        "kthena_router_prefix_cache_evictions_total",
        "extproc_predicted_cached_tokens_total",
        "extproc_routed_prompt_tokens_total",
    } <= wanted
    requests = row_series(REQUESTS_ROW)
    assert {
        "extproc_request_first_byte_seconds_bucket",
        "extproc_request_duration_seconds_bucket",
    } <= requests
    assert wanted | requests <= exposed, sorted((wanted | requests) - exposed)


def test_predicted_and_reported_hit_ratios_are_per_pod_side_by_side() -> None:
    found = queries()
    predicted, reported = found[f"{PREDICTED}/A"], found[f"{PREDICTED}/B"]
    assert predicted == (
        "sum by (pod) (rate(extproc_predicted_cached_tokens_total[1m])) / "
        "sum by (pod) (rate(extproc_routed_prompt_tokens_total[1m]))"
    )
    assert "vllm(:|_)prefix_cache_hits_total" in reported.split(" / ")[0]
    assert "vllm(:|_)prefix_cache_queries_total" in reported.split(" / ")[1]
    assert reported.count("sum by (namespace, pod)") == 2  # the pod's labels, as ns/name
    rows = queries(rows=[REQUESTS_ROW])
    assert [rows[f"Time to first upstream byte p50 / p99/{r}"][:24] for r in "AB"] == [
        "histogram_quantile(0.5, ",
        "histogram_quantile(0.99,",
    ]


def test_flow_control_row_is_collapsed_and_plots_what_was_asked() -> None:
    """Folded away unless flowControl is on: queue length per band, time queued p50/p99,
    dispatches and refusals by reason, saturation per model."""
    dashboard = json.loads(DASHBOARD.read_text())
    [row] = [p for p in dashboard["panels"] if p["title"] == FLOW_ROW]
    assert row["collapsed"] is True
    found = queries(rows=[FLOW_ROW])
    assert not set(found) & set(queries(except_rows=[FLOW_ROW]))
    assert "by (model, priority)" in found["Requests held per band/A"]
    assert [found[f"Time queued p50 / p99/{r}"][:24] for r in "AB"] == [
        "histogram_quantile(0.5, ",
        "histogram_quantile(0.99,",
    ]
    assert "by (reason, priority)" in found["Dispatches by reason/A"]
    assert "by (reason, priority)" in found["Refusals by reason/A"]
    assert "by (model)" in found["Saturated models/A"]


FLOW_SECTION = """
flowControl:
  trustedHeaders: [x-gateway-inference-objective, x-gateway-inference-fairness-id]
  objectives: {standard: 0, sheddable: -1}
  saturation: {maxWaiting: 1}
"""


def test_flow_control_emits_every_series_its_row_reads() -> None:
    """The default configuration with a flowControl section, its registry after a request
    held then routed, one shed and one whose client left: a sample of each series the
    flow-control panels read (a misspelt name in a panel fails here)."""
    config = parse_config(default_config_text() + FLOW_SECTION, "default")
    registry, in_flight = CollectorRegistry(), InFlight()
    scheduler = build_scheduler(config, registry, in_flight)
    router = Router(
        scheduler,
        [make_pod("p0")],
        in_flight=in_flight,
        registry=registry,
        # Not scraped: the pod's in-flight count is its estimate (one slot, maxWaiting 1).
        flow=replace(parse_flow_control(config.flow_control, config.source), scraped=False),
    )

    def send(rid: str, objective: str) -> RouteDecision | Future[RouteDecision]:
        body = b'{"model": "m", "prompt": "hello", "max_tokens": 4}'
        headers = {OBJECTIVE_HEADER: objective, FAIRNESS_HEADER: "tenant"}
        return router.route_or_defer("/v1/completions", body, request_id=rid, headers=headers)

    try:
        first = send("r1", "standard")
        assert isinstance(first, RouteDecision)  # the pod's one slot (maxWaiting 1)
        held, gone = send("r2", "standard"), send("r3", "standard")
        assert isinstance(held, Held) and isinstance(gone, Held)
        with pytest.raises(Overloaded):
            send("r4", "sheddable")
        assert gone.cancel()
        assert router.complete("r1", first.pods[0].address, succeeded=True)
        held.result(timeout=5)
    finally:
        router.close(timeout_s=1)
    exposed = {
        sample.name
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    wanted = {name for expr in queries(rows=[FLOW_ROW]).values() for name in SERIES.findall(expr)}
    assert {
        "extproc_flow_queue_requests",
        "extproc_flow_queued_seconds_bucket",
        "extproc_flow_dispatched_total",
        "extproc_flow_refused_total",
        "extproc_flow_saturated",
    } <= wanted
    assert wanted <= exposed, sorted(wanted - exposed)
