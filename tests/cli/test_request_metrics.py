"""``--request-metrics``: the per-request outcome metrics are on unless turned off."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import CollectorRegistry

from extproc.cli import build_parser
from extproc.cli.app import start
from extproc.routing.outcome_metrics import OutcomeMetrics
from testkit.example_pods import EXAMPLE_PODS_FILE


def serve_args(*extra: str) -> argparse.Namespace:
    ports = ["--grpc-port", "0", "--health-port", "0", "--metrics-port", "0"]
    return build_parser().parse_args(["serve", "--pods", str(EXAMPLE_PODS_FILE), *ports, *extra])


@pytest.mark.parametrize(("flag", "observed"), [((), True), (("--request-metrics", "off"), False)])
def test_outcome_metrics_observe_the_router_unless_turned_off(
    flag: tuple[str, ...], observed: bool
) -> None:
    running = start(serve_args(*flag), CollectorRegistry())
    try:
        kinds = [type(o) for o in running.router.observers]
        assert (OutcomeMetrics in kinds) is observed
    finally:
        running.stop(0.0)
