"""gpu-usage: free KV cache share."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from extproc.pods import PodMetrics
from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.plugins.gpu_usage import GPUCacheUsage
from testkit.factories import make_cycle, make_pod


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        pytest.param([0.0, 1.0], [100, 0], id="empty-and-full"),
        pytest.param([0.25, 0.5], [75, 50], id="quarters"),
        pytest.param([0.333], [66], id="truncated"),
    ],
)
def test_score(usage: list[float], expected: list[int]) -> None:
    plugin = GPUCacheUsage.from_args({"ignored": 1}, PluginContext(CollectorRegistry()))
    pods = [make_pod(f"p{i}", metrics=PodMetrics(kv_usage=u)) for i, u in enumerate(usage)]
    scores = plugin.score(make_cycle("x"), pods)
    assert [scores[p.id] for p in pods] == expected
