"""bench.hot_path drives the whole per-request path: every request routed, its reply
Envoy's, its end recorded for the pod that served it."""

from __future__ import annotations

from bench.hot_path import HotPath
from bench.upstreams import MODEL


def test_each_request_is_routed_ended_and_recorded() -> None:
    path = HotPath(num_pods=4, prompt_bytes=2048, num_prefixes=3)
    for _ in range(12):
        path.one_request()
    assert len(path.router.pending) == 0  # every end matched its route
    sample = path.registry.get_sample_value
    assert sample("extproc_completions_total", {"outcome": "recorded"}) == 12
    assert sample("extproc_route_decisions_total", {"model": MODEL}) == 12


def test_with_requests_in_flight_each_ends_that_many_requests_later() -> None:
    path = HotPath(num_pods=4, prompt_bytes=2048, num_prefixes=3, in_flight=5)
    for _ in range(12):
        path.one_request()
    assert len(path.router.pending) == 5
    sample = path.registry.get_sample_value
    assert sample("extproc_completions_total", {"outcome": "recorded"}) == 7
    for _ in range(5):
        path.end_oldest()
    assert len(path.router.pending) == 0
    assert sample("extproc_completions_total", {"outcome": "recorded"}) == 12
