"""A model is saturated when every ready pod serving it is over a limit: requests in the
pod (scraped, moved by extproc's routing since) beyond its batch slots, or KV use."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from extproc.pods import Pod, PodMetrics
from extproc.routing.flow.config import FlowConfig
from extproc.routing.flow.controller import FlowController
from extproc.routing.flow.saturation import FROZEN_S, SaturationDetector
from extproc.scheduling.inflight import InFlight
from testkit.factories import make_pod

CONFIG = FlowConfig(enabled=True, max_waiting=2, max_kv_usage=0.9)


def scraped(
    running: int, waiting: int = 0, kv: float = 0.0, name: str = "p0", port: int = 8000
) -> Pod:
    return make_pod(name, port=port, metrics=PodMetrics(waiting, running, kv))


def seen_full(sink: SaturationDetector | FlowController, pods: tuple[Pod, ...]) -> None:
    """Two scrapes in a row showing ``pods`` as they are (queueing: their size known)."""
    sink.pods_changed(pods)
    sink.pods_changed(tuple(replace(p, metrics=replace(p.metrics)) for p in pods))


def test_requests_routed_since_the_scrape_count_at_once() -> None:
    in_flight = InFlight()
    detector = SaturationDetector(CONFIG, in_flight)
    pod = scraped(running=4, waiting=1)  # full: it has 4 slots
    seen_full(detector, (pod,))
    assert detector.estimated_waiting(pod) == 1 and not detector.saturated("m", 0)
    in_flight.start(pod.id)  # routed after the scrape
    assert detector.estimated_waiting(pod) == 2 and detector.saturated("m", 0)
    rescraped = scraped(running=4, waiting=0)  # the next scrape takes a new baseline
    detector.pods_changed((rescraped,))
    assert detector.estimated_waiting(rescraped) == 0 and not detector.saturated("m", 0)


def test_requests_that_take_free_slots_are_not_waiting() -> None:
    in_flight = InFlight()
    detector = SaturationDetector(FlowConfig(enabled=True, max_waiting=0), in_flight)
    seen_full(detector, (scraped(running=4, waiting=2),))  # 4 slots
    pod = scraped(running=2)
    detector.pods_changed((pod,))
    assert detector.estimated_waiting(pod) == -2 and not detector.over(pod)
    in_flight.start(pod.id)
    assert not detector.over(pod)  # one slot still free
    in_flight.start(pod.id)
    assert detector.over(pod)  # every slot busy: maxWaiting 0 holds the next
    in_flight.end(pod.id)  # an end frees a slot before the next scrape
    assert not detector.over(pod)


def test_a_pod_never_seen_full_is_over_only_by_its_kv_use() -> None:
    """The most a pod ran so far may be far below its batch size: until a scrape shows
    it queueing, its engine takes what comes (as without flow control), so a fresh
    extproc does not ramp a pool up one request a scrape."""
    in_flight = InFlight()
    detector = SaturationDetector(FlowConfig(enabled=True, max_waiting=0), in_flight)
    pod = scraped(running=1)
    detector.pods_changed((pod,))
    for _ in range(10):
        in_flight.start(pod.id)
    assert not detector.over(pod)
    queueing = scraped(running=8, waiting=3)
    seen_full(detector, (queueing,))
    assert detector.over(queueing)  # 8 slots, 11 in it: 3 waiting
    detector.pods_changed((scraped(running=1, kv=0.95),))
    assert detector.saturated("m", 0)


def test_without_scraping_the_in_flight_count_is_capped() -> None:
    in_flight = InFlight()
    detector = SaturationDetector(FlowConfig(enabled=True, max_waiting=2, scraped=False), in_flight)
    pod = make_pod("p0")
    detector.pods_changed((pod,))
    in_flight.start(pod.id)
    assert not detector.over(pod)
    in_flight.start(pod.id)
    assert detector.over(pod)


def test_kv_use_alone_saturates_and_one_pod_with_room_keeps_the_model_open() -> None:
    detector = SaturationDetector(CONFIG, InFlight())
    full = scraped(0, kv=0.95)
    room = scraped(0, kv=0.5, name="p1", port=8001)
    detector.pods_changed((full, room))
    assert not detector.saturated("m", 0)
    detector.pods_changed((full, scraped(0, kv=0.9, name="p1", port=8001)))
    assert detector.saturated("m", 0)


def test_pods_not_ready_or_serving_another_model_do_not_count() -> None:
    detector = SaturationDetector(CONFIG, InFlight())
    full = scraped(running=0, waiting=5)
    unready = make_pod("p1", port=8001, ready=False)
    other = make_pod("p2", port=8002, model="other")
    seen_full(detector, (full, unready, other))
    assert detector.saturated("m", 0)
    assert not detector.saturated("nobody-serves-this", 0)  # routing answers it, not us


def test_requests_routed_before_a_scrape_was_published_still_count() -> None:
    """The pod answered its scrape before extproc routed its fifth request, and the
    scrape was published after: the scrape shows four, extproc knows of five."""
    in_flight = InFlight()
    detector = SaturationDetector(FlowConfig(enabled=True, max_waiting=1), in_flight)
    seen_full(detector, (scraped(running=4, waiting=1),))  # 4 slots
    for _ in range(5):
        in_flight.start(make_pod("p0").id)
    pod = scraped(running=3, waiting=1)
    detector.pods_changed((pod,))
    assert detector.estimated_waiting(pod) == 1 and detector.over(pod)


def test_one_scrape_catching_a_request_waiting_for_the_next_step_is_not_full() -> None:
    """At any load a request waits a moment for the engine's next step, and a scrape may
    catch it: a pod taken for full at the two requests it ran then would hold (and, with
    a reserve, refuse) the low bands at half its size. Two scrapes in a row queueing
    tell its size."""
    in_flight = InFlight()
    config = FlowConfig(enabled=True, max_waiting=0, reserved_slots=1, reserved_for=100)
    detector = SaturationDetector(config, in_flight)
    for _ in range(3):
        in_flight.start(make_pod("p0").id)
    detector.pods_changed((scraped(running=2, waiting=1),))
    calm = scraped(running=3)
    detector.pods_changed((calm,))
    assert detector.free_slots(calm) == float("inf") and not detector.saturated("m", 0)
    detector.pods_changed((scraped(running=3, waiting=1),))
    queueing = scraped(running=3, waiting=1)
    detector.pods_changed((queueing,))  # the second in a row: 3 slots, none free
    assert detector.free_slots(queueing) == 0 and detector.saturated("m", 0)


def test_a_burst_queueing_several_at_once_tells_the_size_at_its_first_scrape() -> None:
    in_flight = InFlight()
    detector = SaturationDetector(FlowConfig(enabled=True, max_waiting=0), in_flight)
    for _ in range(6):
        in_flight.start(make_pod("p0").id)
    burst = scraped(running=4, waiting=2)
    detector.pods_changed((burst,))
    assert detector.free_slots(burst) == 0 and detector.saturated("m", 0)


def test_batch_slots_given_make_the_size_known_before_the_pod_is_ever_full() -> None:
    """A burst from idle is held at the pods' slots from its first request, instead of
    queueing in the engines until a scrape shows them full; a scrape showing more
    running grows the slots."""
    in_flight = InFlight()
    config = FlowConfig(enabled=True, max_waiting=0, reserved_slots=1, reserved_for=100)
    told = SaturationDetector(replace(config, batch_slots=4), in_flight)
    learning = SaturationDetector(config, in_flight)
    idle = scraped(running=0)
    for detector in (told, learning):
        detector.pods_changed((idle,))
    for _ in range(3):
        in_flight.start(idle.id)
    assert told.free_slots(idle) == 1 and told.saturated("m", 0)
    assert not told.saturated("m", 100)
    assert learning.free_slots(idle) == float("inf") and not learning.saturated("m", 0)
    told.pods_changed((scraped(running=6),))  # 6 running: its slots are 6
    calm = scraped(running=2)
    told.pods_changed((calm,))
    assert told.free_slots(calm) == 3  # 6 slots, our 3 requests in it


def test_the_reserve_keeps_the_last_room_for_the_high_band() -> None:
    in_flight = InFlight()
    config = FlowConfig(enabled=True, max_waiting=0, reserved_slots=2, reserved_for=100)
    detector = SaturationDetector(config, in_flight)
    seen_full(detector, (scraped(4, 1), scraped(4, 1, name="p1", port=8001)))  # 4 slots each
    quiet = (scraped(2), scraped(3, name="p1", port=8001))  # 2 + 1 slots free
    detector.pods_changed(quiet)
    assert detector.room(quiet[0]) == 2 and detector.room(quiet[1]) == 1
    assert not detector.saturated("m", 0) and not detector.saturated("m", 100)
    in_flight.start(quiet[0].id)  # 2 free: the reserve
    assert detector.saturated("m", 0) and not detector.saturated("m", 100)
    in_flight.start(quiet[0].id)
    in_flight.start(quiet[1].id)
    assert detector.saturated("m", 100)


def test_the_reserve_counts_free_slots_not_queue_places() -> None:
    """A high-band request sent to a queue place (``maxWaiting``'s or a probe's) waits
    there behind a full batch: only free slots keep the reserve."""
    in_flight = InFlight()
    config = FlowConfig(enabled=True, max_waiting=1, reserved_slots=1, reserved_for=100)
    detector = SaturationDetector(config, in_flight)
    seen_full(detector, (scraped(4, 1), scraped(4, 1, name="p1", port=8001)))  # 4 slots
    busy = (scraped(4), scraped(2, name="p1", port=8001))  # 0 and 2 slots free
    detector.pods_changed(busy)
    assert [detector.free_slots(p) for p in busy] == [0, 2]
    assert [detector.room(p) for p in busy] == [2, 3]  # p0: its queue place and a probe
    assert not detector.saturated("m", 0)
    in_flight.start(busy[1].id)  # one slot left (the reserve), three queue places
    assert detector.saturated("m", 0) and not detector.saturated("m", 100)
    in_flight.start(busy[1].id)  # no slot left: the high band takes a queue place
    assert detector.free_slots(busy[1]) == 0 and not detector.saturated("m", 100)


def test_a_request_from_the_queue_takes_a_free_slot_over_a_queue_place() -> None:
    in_flight = InFlight()
    controller = FlowController(
        FlowConfig(enabled=True, max_waiting=1), in_flight, CollectorRegistry()
    )
    try:
        seen_full(controller, (scraped(4, 1), scraped(4, 1, name="p1", port=8001)))
        busy = (scraped(4), scraped(3, name="p1", port=8001))  # a queue place; a slot
        controller.pods_changed(busy)
        assert [p.id for p in controller.with_room(busy)] == [busy[1].id]
        in_flight.start(busy[1].id)  # no slot free: either queue place
        assert [p.id for p in controller.with_room(busy)] == [busy[0].id, busy[1].id]
    finally:
        controller.close()


def test_a_pod_of_unknown_size_leaves_room_beyond_any_reserve() -> None:
    config = FlowConfig(enabled=True, reserved_slots=50, reserved_for=100)
    detector = SaturationDetector(config, InFlight())
    detector.pods_changed((scraped(3),))
    assert not detector.saturated("m", 0)


def test_slots_learned_low_grow_by_a_probe() -> None:
    """Seen queueing at 3 running (a request waiting for the engine's next step), the pod
    has 4 slots: while a scrape shows it running its most with nothing queued, one more
    request goes in, and the next scrape shows the fourth slot."""
    in_flight = InFlight()
    detector = SaturationDetector(FlowConfig(enabled=True, max_waiting=0), in_flight)
    seen_full(detector, (scraped(running=3, waiting=1),))
    pod_id = make_pod("p0").id
    for _ in range(3):
        in_flight.start(pod_id)
    calm = scraped(running=3)
    detector.pods_changed((calm,))
    assert not detector.over(calm)  # the probe
    in_flight.start(pod_id)
    assert detector.over(calm)
    grown = scraped(running=4)
    detector.pods_changed((grown,))
    assert detector.estimated_waiting(grown) == 0 and not detector.over(grown)
    in_flight.start(pod_id)
    assert detector.over(grown)
    for _ in range(2):  # at its size: the next scrapes probe no more (for a while)
        in_flight.end(pod_id)
        steady = scraped(running=4)
        detector.pods_changed((steady,))
        assert detector.estimated_waiting(steady) == 0 and detector.over(steady)
        in_flight.start(pod_id)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_frozen_reading_lets_one_request_at_a_time_wake_the_pod() -> None:
    """vLLM keeps its gauges after aborting every request it ran (until its next step):
    a reading over the limits, unchanged for FROZEN_S with nothing in flight, lets one
    request in at a time, until a new reading tells the pod's real state."""
    in_flight, clock = InFlight(), Clock()
    detector = SaturationDetector(CONFIG, in_flight, clock)
    aborted = scraped(running=4, waiting=3, kv=0.95)  # the last step before the cancels
    seen_full(detector, (aborted,))
    assert detector.over(aborted) and detector.room(aborted) == 0
    clock.now += FROZEN_S - 0.1
    assert detector.over(aborted) and detector.saturated("m", 0)  # not yet frozen
    clock.now += 0.1
    assert detector.frozen(aborted) and detector.frozen_over() == 1
    assert not detector.over(aborted) and not detector.saturated("m", 0)
    assert detector.room(aborted) == detector.free_slots(aborted) == 1
    in_flight.start(aborted.id)  # the request that wakes it: one at a time
    assert detector.over(aborted) and detector.room(aborted) == 0
    assert detector.saturated("m", 0) and detector.frozen_over() == 0
    awake = scraped(running=1)  # its next step: the aborted requests are gone
    detector.pods_changed((awake,))
    clock.now += 10 * FROZEN_S
    in_flight.end(awake.id)
    assert not detector.over(awake) and detector.frozen_over() == 0  # not over: not frozen


@pytest.mark.parametrize(
    ("in_flight_there", "unchanged_s", "frozen"),
    [
        pytest.param(0, FROZEN_S, True, id="idle-and-unchanged"),
        pytest.param(0, FROZEN_S / 2, False, id="unchanged-briefly"),
        pytest.param(1, 10 * FROZEN_S, False, id="a-request-in-flight"),
    ],
)
def test_frozen_needs_nothing_in_flight_and_the_same_reading(
    in_flight_there: int, unchanged_s: float, frozen: bool
) -> None:
    in_flight, clock = InFlight(), Clock()
    detector = SaturationDetector(CONFIG, in_flight, clock)
    pod = scraped(running=0, kv=0.95)
    detector.pods_changed((pod,))
    for _ in range(in_flight_there):
        in_flight.start(pod.id)
    clock.now += unchanged_s
    assert detector.frozen(pod) is frozen
    assert detector.over(pod) is not frozen


def test_a_new_reading_restarts_the_wait() -> None:
    """A pod at its limits serving requests changes its reading at each step: each new
    reading is a new baseline, so it is never taken for frozen."""
    in_flight, clock = InFlight(), Clock()
    detector = SaturationDetector(CONFIG, in_flight, clock)
    for step in range(5):
        busy = scraped(running=0, kv=0.95 + step / 1000)
        detector.pods_changed((busy,))
        clock.now += FROZEN_S / 2
        assert detector.over(busy)
