"""Flow control end to end over a Router: hold while saturated, dispatch when a pod
frees, refuse sheddable and expired requests, evict by priority, cancel, drain."""

from __future__ import annotations

import time
from concurrent.futures import CancelledError

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.errors import Overloaded
from extproc.pods import PodMetrics
from extproc.routing.decision import RouteDecision
from extproc.routing.flow.config import FAIRNESS_HEADER, OBJECTIVE_HEADER, FlowConfig
from extproc.routing.flow.held import Held
from extproc.routing.records import Shared, Started
from extproc.routing.router import Router
from testkit.factories import PREFIX_ONLY, make_pod, make_scheduler

PATH = "/v1/completions"
BODY = orjson.dumps({"model": "m", "prompt": "hello there", "max_tokens": 8})
TRUSTED = frozenset({OBJECTIVE_HEADER, FAIRNESS_HEADER})
OBJECTIVES = {"critical": 100, "standard": 0, "sheddable": -1}


def make_router(**changes: object) -> tuple[Router, CollectorRegistry]:
    settings: dict[str, object] = {
        "enabled": True,
        "trusted_headers": TRUSTED,
        "objectives": OBJECTIVES,
        "max_waiting": 1,
        "ttl_s": 5.0,
        "scraped": False,  # the pods' in-flight count is the whole estimate: exact here
    }
    settings.update(changes)
    registry = CollectorRegistry()
    router = Router(
        make_scheduler(PREFIX_ONLY),
        [make_pod("p0")],
        registry=registry,
        flow=FlowConfig(**settings),  # type: ignore[arg-type]
    )
    return router, registry


def send(router: Router, rid: str, objective: str = "standard", tenant: str = "t") -> object:
    headers = {OBJECTIVE_HEADER: objective, FAIRNESS_HEADER: tenant}
    return router.route_or_defer(PATH, BODY, request_id=rid, headers=headers)


def settle(held: Held, timeout: float = 3.0) -> RouteDecision:
    return held.result(timeout)


def test_below_saturation_requests_are_routed_at_once() -> None:
    router, registry = make_router(max_waiting=3)
    assert isinstance(send(router, "r1"), RouteDecision)
    assert isinstance(send(router, "r2"), RouteDecision)
    assert (
        registry.get_sample_value(
            "extproc_flow_dispatched_total", {"priority": "0", "reason": "not_saturated"}
        )
        == 2
    )


def test_a_held_request_is_routed_when_a_pod_frees() -> None:
    router, registry = make_router()
    first = send(router, "r1")
    assert isinstance(first, RouteDecision)  # the pod's one slot (max_waiting 1)
    held = send(router, "r2")
    assert isinstance(held, Held) and not held.done()
    assert registry.get_sample_value("extproc_flow_saturated", {"model": "m"}) == 1
    assert (
        registry.get_sample_value("extproc_flow_queue_requests", {"model": "m", "priority": "0"})
        == 1
    )
    time.sleep(0.2)
    assert not held.done()  # still saturated: held, nothing sent to the pod
    router.complete("r1", first.pods[0].address, succeeded=True)
    decision = settle(held)
    assert decision.pods[0].address == first.pods[0].address
    assert len(router.pending) == 1  # r2, tracked as any routed request
    assert (
        registry.get_sample_value(
            "extproc_flow_dispatched_total", {"priority": "0", "reason": "capacity"}
        )
        == 1
    )


def test_bands_are_strict_when_capacity_frees() -> None:
    router, _ = make_router()
    first = send(router, "r0")
    assert isinstance(first, RouteDecision)
    standard = send(router, "s1")
    critical = send(router, "c1", "critical")
    assert isinstance(standard, Held) and isinstance(critical, Held)
    router.complete("r0", first.pods[0].address, succeeded=True)
    settle(critical)
    time.sleep(0.2)
    assert not standard.done()  # the critical one took the freed slot


def test_sheddable_requests_are_refused_at_once_while_saturated() -> None:
    router, registry = make_router()
    send(router, "r0")
    with pytest.raises(Overloaded) as refused:
        send(router, "x", "sheddable")
    assert refused.value.http_status == 429 and refused.value.code == "shed"
    assert refused.value.retry_after_s == 1
    assert (
        registry.get_sample_value("extproc_route_errors_total", {"status": "429", "code": "shed"})
        == 1
    )


def test_sheddable_requests_are_refused_while_others_are_held() -> None:
    """Room freed for the held requests is theirs: a sheddable one arriving meanwhile is
    refused, not queued behind them to time out."""
    router, _ = make_router()
    first = send(router, "r0")
    held = send(router, "r1")
    assert isinstance(first, RouteDecision) and isinstance(held, Held)
    router.in_flight.end(first.pods[0].id)  # room, the dispatcher not woken yet
    with pytest.raises(Overloaded) as refused:
        send(router, "x", "sheddable")
    assert refused.value.code == "shed"
    settle(held)


def test_a_request_whose_time_to_live_ends_is_refused_with_retry_after() -> None:
    router, registry = make_router(ttl_s=0.3, retry_after_s=4)
    send(router, "r0")
    held = send(router, "r1")
    assert isinstance(held, Held)
    with pytest.raises(Overloaded) as refused:
        held.result(3)
    assert refused.value.code == "queue_timeout" and refused.value.retry_after_s == 4
    assert len(router.pending) == 1  # r0 only: r1 was never routed
    assert (
        registry.get_sample_value(
            "extproc_flow_refused_total", {"priority": "0", "reason": "queue_timeout"}
        )
        == 1
    )


def test_a_cancelled_request_leaves_the_queue_and_is_never_routed() -> None:
    router, registry = make_router()
    first = send(router, "r0")
    held = send(router, "r1")
    assert isinstance(first, RouteDecision) and isinstance(held, Held)
    assert held.cancel()
    assert router.flow is not None and router.flow.held == 0
    assert registry.get_sample_value("extproc_flow_cancelled_total", {"priority": "0"}) == 1
    router.complete("r0", first.pods[0].address, succeeded=True)
    time.sleep(0.2)
    assert len(router.pending) == 0
    with pytest.raises(CancelledError):
        held.result(0)


def test_a_full_queue_refuses_or_evicts_the_newest_of_a_lower_band() -> None:
    router, registry = make_router(max_requests=2)
    send(router, "r0")
    older, newer = send(router, "s1"), send(router, "s2")
    with pytest.raises(Overloaded) as full:
        send(router, "s3")
    assert full.value.code == "queue_full"
    critical = send(router, "c1", "critical")
    assert isinstance(critical, Held) and isinstance(newer, Held) and isinstance(older, Held)
    with pytest.raises(Overloaded) as evicted:
        newer.result(1)
    assert evicted.value.code == "evicted" and not older.done()
    assert (
        registry.get_sample_value(
            "extproc_flow_refused_total", {"priority": "0", "reason": "evicted"}
        )
        == 1
    )


def test_the_drain_routes_every_held_request() -> None:
    router, registry = make_router()
    send(router, "r0")
    held = [send(router, f"r{i}") for i in range(1, 4)]
    assert all(isinstance(h, Held) for h in held)
    router.close(1.0)
    assert all(isinstance(settle(h), RouteDecision) for h in held)  # type: ignore[arg-type]
    assert (
        registry.get_sample_value(
            "extproc_flow_dispatched_total", {"priority": "0", "reason": "drain"}
        )
        == 3
    )


def test_a_scrape_showing_room_dispatches() -> None:
    router, _ = make_router(scraped=True)
    for _ in range(2):  # two scrapes in a row queueing: full
        router.set_pods([make_pod("p0", metrics=PodMetrics(waiting=3))])
    held = send(router, "r1")
    assert isinstance(held, Held)
    router.set_pods([make_pod("p0", metrics=PodMetrics(waiting=0))])
    assert isinstance(settle(held), RouteDecision)


def test_off_is_todays_behaviour() -> None:
    router, _ = make_router(enabled=False)
    assert router.flow is None
    assert all(isinstance(send(router, f"r{i}"), RouteDecision) for i in range(5))


def test_another_replicas_pick_counts_towards_saturation() -> None:
    """Replicas share their picks (Redis in production; applied directly here): the pod's
    one slot taken by replica a is full for replica b too, and b's request is held until
    a's request ends and that end reaches b."""
    published: list[Shared | Started] = []
    a = Router(
        make_scheduler(PREFIX_ONLY),
        [make_pod("p0")],
        registry=CollectorRegistry(),
        share=published.append,
        flow=FlowConfig(enabled=True, max_waiting=1, scraped=False),
    )
    b, _ = make_router()
    first = a.route_or_defer(PATH, BODY, request_id="ra")
    assert isinstance(first, RouteDecision)
    started = published.pop()
    assert isinstance(started, Started) and b.apply_started(started)
    held = send(b, "rb")
    assert isinstance(held, Held) and not held.done()
    a.complete("ra", first.pods[0].address, succeeded=True)
    ended = published.pop()
    assert isinstance(ended, Shared) and b.apply_shared(ended)  # recorded there too
    assert isinstance(settle(held), RouteDecision)


def test_a_held_request_goes_where_room_freed_not_where_its_prefix_is() -> None:
    registry = CollectorRegistry()
    pods = [make_pod("p0"), make_pod("p1", port=8001)]
    router = Router(
        make_scheduler(PREFIX_ONLY),
        pods,
        registry=registry,
        flow=FlowConfig(enabled=True, max_waiting=1, scraped=False),
    )
    warm = router.route_or_defer(PATH, BODY, request_id="warm")
    assert isinstance(warm, RouteDecision)
    router.complete("warm", warm.pods[0].address, succeeded=True)  # its prefix is there
    cached = warm.pods[0]
    other = next(p for p in pods if p.id != cached.id)
    for pod in pods:
        router.in_flight.start(pod.id)  # both busy
    held = send(router, "again")
    assert isinstance(held, Held)
    router.in_flight.end(other.id)  # room frees on the other pod only
    assert router.flow is not None
    router.flow.wake()
    assert settle(held).pods[0].id == other.id


def test_with_a_reserve_the_high_band_passes_while_the_low_one_is_held() -> None:
    router, _ = make_router(max_waiting=3, reserved_slots=1, reserved_for=100)
    first, second = send(router, "r1"), send(router, "r2")
    assert isinstance(first, RouteDecision) and isinstance(second, RouteDecision)
    standard = send(router, "s1")  # one place left: the reserve
    assert isinstance(standard, Held)
    critical = send(router, "c1", "critical")
    assert isinstance(critical, RouteDecision)
    router.complete("r1", first.pods[0].address, succeeded=True)
    time.sleep(0.2)
    assert not standard.done()  # the freed place refills the reserve
    router.complete("r2", second.pods[0].address, succeeded=True)
    assert isinstance(settle(standard), RouteDecision)


def test_a_sheddable_request_is_held_where_only_the_reserve_is_in_its_way() -> None:
    """Shedding is for overload: at a burst that leaves only the reserve, a sheddable
    request waits like the rest; once the pods are full it is refused at once."""
    router, _ = make_router(max_waiting=3, reserved_slots=1, reserved_for=100)
    assert all(isinstance(send(router, f"r{i}"), RouteDecision) for i in range(2))
    held = send(router, "x1", "sheddable")  # one place left: the reserve
    assert isinstance(held, Held)
    held.cancel()
    assert isinstance(send(router, "c1", "critical"), RouteDecision)  # now full
    with pytest.raises(Overloaded) as refused:
        send(router, "x2", "sheddable")
    assert refused.value.code == "shed"


def test_while_saturated_lately_a_request_admitted_at_once_takes_the_room_left() -> None:
    """The reserve's last place is on p1; the critical request's prefix is on p0, which is
    full: it goes to p1 rather than queue at p0 behind the request there."""
    pods = [make_pod("p0"), make_pod("p1", port=8001)]
    router = Router(
        make_scheduler(PREFIX_ONLY),
        pods,
        registry=CollectorRegistry(),
        flow=FlowConfig(
            enabled=True,
            trusted_headers=TRUSTED,
            objectives=OBJECTIVES,
            max_waiting=1,
            reserved_slots=1,
            reserved_for=100,
            scraped=False,
        ),
    )
    warm = router.route_or_defer(PATH, BODY, request_id="warm")
    assert isinstance(warm, RouteDecision)
    router.complete("warm", warm.pods[0].address, succeeded=True)
    cached = warm.pods[0]
    other = next(p for p in pods if p.id != cached.id)
    for pod in (cached, other):
        router.in_flight.start(pod.id)  # both full: saturated, the model hot
    standard = send(router, "s1")
    assert isinstance(standard, Held)
    router.in_flight.end(other.id)  # p1's place frees: the reserve, kept while hot
    critical = send(router, "c1", "critical")
    assert isinstance(critical, RouteDecision) and critical.pods[0].id == other.id
    assert not standard.done()
    standard.cancel()
