"""The Grafana dashboard's queries, as Prometheus would run them (shared with e2e)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "charts/extproc/dashboards/extproc.json"


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(rate_interval: str = "1m") -> dict[str, str]:
    """``"panel title/refId" -> PromQL``, with Grafana's ``$__rate_interval`` filled in."""
    dashboard = json.loads(DASHBOARD.read_text())
    return {
        f"{panel['title']}/{target['refId']}": target["expr"].replace(
            "$__rate_interval", rate_interval
        )
        for panel in panels(dashboard)
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
