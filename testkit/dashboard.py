"""The Grafana dashboard's queries, as Prometheus would run them (shared with e2e)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "charts/extproc/dashboards/extproc.json"
PRECISE_ROW = "Precise prefix cache (KV events)"  # data only with precise-prefix-cache on
FLOW_ROW = "Flow control"  # most of its series appear only once a request was held


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def panels_by_row(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(row title, panel) for every panel under a row: a collapsed row holds its panels,
    an open one is followed by them."""
    row = ""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            yield from ((row, p) for p in panel.get("panels", []))
        else:
            yield row, panel


def queries(
    rate_interval: str = "1m",
    *,
    rows: Collection[str] | None = None,
    except_rows: Collection[str] = (),
) -> dict[str, str]:
    """``"panel title/refId" -> PromQL``, with Grafana's ``$__rate_interval`` filled in;
    the panels of ``rows`` only (None: every row) and not of ``except_rows``."""
    dashboard = json.loads(DASHBOARD.read_text())
    return {
        f"{panel['title']}/{target['refId']}": target["expr"].replace(
            "$__rate_interval", rate_interval
        )
        for row, panel in panels_by_row(dashboard)
        if (rows is None or row in rows) and row not in except_rows
        for target in panel.get("targets", [])
    }


def require_binary(name: str) -> str:
    """The path of a Prometheus tool; a missing one is an install error, not a skip."""
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(
            f"{name} not found: install Debian's prometheus package "
            "(apt-get install prometheus; .ci/run does)"
        )
    return path
