"""The router's observers: told of each decision and each end, never in the way."""

from __future__ import annotations

import time

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.routing.decision import RouteDecision
from extproc.routing.flow.config import FlowConfig
from extproc.routing.flow.held import Held
from extproc.routing.observe import Ended, EndTiming, Routed
from extproc.routing.router import Router
from testkit.factories import PREFIX_ONLY, make_pod, make_scheduler

PATH = "/v1/completions"
BODY = orjson.dumps({"model": "m", "prompt": "hello there " * 40, "max_tokens": 8})


class Seen:
    def __init__(self) -> None:
        self.routed: list[Routed] = []
        self.ended: list[Ended] = []


class Observer:
    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    def routed(self, routed: Routed) -> None:
        self.seen.routed.append(routed)

    def ended(self, ended: Ended) -> None:
        self.seen.ended.append(ended)


class Broken:
    def routed(self, routed: Routed) -> None:
        raise RuntimeError("observer bug")

    def ended(self, ended: Ended) -> None:
        raise RuntimeError("observer bug")


def make_router(flow: FlowConfig | None = None, pods: int = 3) -> tuple[Router, Seen]:
    router = Router(
        make_scheduler(PREFIX_ONLY),
        [make_pod(f"p{i}", port=8000 + i) for i in range(pods)],
        registry=CollectorRegistry(),
        flow=flow,
    )
    seen = Seen()
    router.observers.append(Observer(seen))
    return router, seen


def test_a_decision_is_told_with_its_pods_and_times() -> None:
    router, seen = make_router()
    before = time.time_ns()
    decision = router.route(PATH, BODY, request_id="r1", headers={"traceparent": "00-x"})
    (routed,) = seen.routed
    assert routed.request_id == "r1" and routed.model == "m"
    assert routed.pods == decision.pods and routed.num_candidates == 3
    assert routed.headers == {"traceparent": "00-x"}
    assert routed.arrived_s <= routed.decided_s
    assert before - 10**9 < routed.arrived_unix_ns <= time.time_ns()
    assert routed.queued_s == 0 and routed.prompt_tokens > 0 and not routed.exact


def test_an_end_is_told_with_the_serving_pod_and_the_access_log_timing() -> None:
    router, seen = make_router()
    decision = router.route(PATH, BODY, request_id="r1")
    timing = EndTiming(0.01, 0.5, 300, 2000, 200)
    router.complete("r1", decision.pods[1].address, succeeded=True, attempts=2, timing=timing)
    (ended,) = seen.ended
    assert ended.pod == decision.pods[1].id and ended.model == "m"
    assert ended.succeeded and ended.attempts == 2 and ended.timing == timing
    assert ended.prompt_tokens == seen.routed[0].prompt_tokens


def test_an_unknown_request_ends_without_a_model_or_prediction() -> None:
    router, seen = make_router()
    router.complete("nobody", router.pods[0].address, succeeded=True)
    (ended,) = seen.ended
    assert ended.model is None and ended.pod == router.pods[0].id
    assert ended.prompt_tokens is None and ended.predicted_cached_tokens is None


def test_a_held_request_reports_the_time_it_was_queued() -> None:
    flow = FlowConfig(enabled=True, max_waiting=1, ttl_s=5.0, scraped=False)
    router, seen = make_router(flow, pods=1)
    first = router.route_or_defer(PATH, BODY, request_id="r1")
    assert isinstance(first, RouteDecision)
    held = router.route_or_defer(PATH, BODY, request_id="r2")
    assert isinstance(held, Held)
    time.sleep(0.05)
    router.complete("r1", first.pods[0].address, succeeded=True)
    held.result(3.0)
    assert seen.routed[1].queued_s >= 0.05


def test_a_failing_observer_is_logged_and_the_request_is_routed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router, seen = make_router()
    router.observers.insert(0, Broken())
    decision = router.route(PATH, BODY, request_id="r1")
    assert router.complete("r1", decision.pods[0].address, succeeded=True)
    assert len(seen.routed) == len(seen.ended) == 1  # the next observer is still told
    assert "observer Broken failed" in caplog.text
