"""The Grafana dashboard: Grafana's dashboard schema, PromQL that parses, the panels asked for.

The schema is the ``Dashboard`` type of the npm package @grafana/schema, generated into
grafana/dashboard.schema.json by grafana/generate.sh (Grafana itself is not installable
here). PromQL is parsed by ``promtool check rules`` from Debian's prometheus package.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import yaml

from tests.charts.dashboard import DASHBOARD, PRECISE_ROW, panels, queries, require_binary

SCHEMA = Path(__file__).parent / "grafana" / "dashboard.schema.json"
HIT_RATE_BUCKET = 'kthena_router_prefix_cache_match_ratio_bucket{le="0.0"}'


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
        "Errors",
        "Pod load",
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
    """Folded away unless kvEvents is on; its panels cover what the README's metrics
    table lists for the precise plugin and the KV-events subscriber."""
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
