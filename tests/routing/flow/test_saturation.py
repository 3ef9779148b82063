"""A model is saturated when every ready pod serving it is over a limit."""

from __future__ import annotations

from extproc.pods import PodMetrics
from extproc.routing.flow.config import FlowConfig
from extproc.routing.flow.saturation import SaturationDetector
from extproc.scheduling.inflight import InFlight
from testkit.factories import make_pod

CONFIG = FlowConfig(enabled=True, max_waiting=2, max_kv_usage=0.9)


def test_requests_routed_since_the_scrape_count_as_waiting() -> None:
    in_flight = InFlight()
    pod = make_pod("p0", metrics=PodMetrics(waiting=1))
    detector = SaturationDetector(CONFIG, in_flight)
    in_flight.start(pod.id)  # in flight before the scrape: already in its numbers
    detector.pods_changed((pod,))
    assert detector.estimated_waiting(pod) == 1 and not detector.saturated("m")
    in_flight.start(pod.id)  # routed after the scrape
    assert detector.estimated_waiting(pod) == 2 and detector.saturated("m")
    rescraped = make_pod("p0", metrics=PodMetrics(waiting=0))
    detector.pods_changed((rescraped,))  # the next scrape takes a new baseline
    assert detector.estimated_waiting(rescraped) == 0 and not detector.saturated("m")


def test_ends_since_the_scrape_lower_the_estimate_but_not_below_zero() -> None:
    in_flight = InFlight()
    pod = make_pod("p0", metrics=PodMetrics(waiting=1))
    for _ in range(3):
        in_flight.start(pod.id)
    detector = SaturationDetector(CONFIG, in_flight)
    detector.pods_changed((pod,))
    for _ in range(3):
        in_flight.end(pod.id)
    assert detector.estimated_waiting(pod) == 0


def test_kv_use_alone_saturates_and_one_pod_with_room_keeps_the_model_open() -> None:
    detector = SaturationDetector(CONFIG, InFlight())
    full = make_pod("p0", metrics=PodMetrics(kv_usage=0.95))
    room = make_pod("p1", port=8001, metrics=PodMetrics(kv_usage=0.5))
    detector.pods_changed((full, room))
    assert not detector.saturated("m")
    detector.pods_changed((full, make_pod("p1", port=8001, metrics=PodMetrics(kv_usage=0.9))))
    assert detector.saturated("m")


def test_pods_not_ready_or_serving_another_model_do_not_count() -> None:
    detector = SaturationDetector(CONFIG, InFlight())
    full = make_pod("p0", metrics=PodMetrics(waiting=5))
    unready = make_pod("p1", port=8001, ready=False)
    other = make_pod("p2", port=8002, model="other")
    detector.pods_changed((full, unready, other))
    assert detector.saturated("m")
    assert not detector.saturated("nobody-serves-this")  # routing answers it, not us
