"""Flow control through real Envoy and simulated pods (``e2e/flow-control.yaml``): each
pod takes one request at a time (no scraping: a pod's waiting estimate is extproc's
in-flight count), so with every pod busy (a ``delay_s`` fault holds each request) the
next requests are held in extproc until a pod frees, best band first, fair between
tenants; sheddable ones are refused at once, and a held request whose time to live ends
gets 429 with Retry-After."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e.support import MODEL, metric
from extproc.sim.launch import SimPods, Stack, run_stack
from testkit.waiting import wait_until

CONFIG = Path(__file__).with_name("flow-control.yaml")
NO_SCRAPING = ["--stale-after-s", "0"]
OBJECTIVE = "x-gateway-inference-objective"
TENANT = "x-gateway-inference-fairness-id"
DELAY_S = 1.0  # each pod holds each request this long


@pytest.fixture(scope="module")
def flow_stack(sim: SimPods) -> Iterator[Stack]:
    with run_stack(sim.as_pods(), config=CONFIG, extproc_args=NO_SCRAPING) as running:
        yield running


class Sent:
    """A request sent on its own thread: its answer and when it came (since ``t0``)."""

    def __init__(
        self, stack: Stack, objective: str = "standard", tenant: str = "t", timeout: float = 30
    ) -> None:
        self.headers = {OBJECTIVE: objective, TENANT: tenant}
        self.answer: httpx.Response | None = None
        self.error: Exception | None = None
        self.ended = 0.0
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._send, args=(stack.url, timeout))
        self._thread.start()

    def _send(self, url: str, timeout: float) -> None:
        body = {"model": MODEL, "prompt": "flow control", "max_tokens": 2}
        try:
            self.answer = httpx.post(
                url + "/v1/completions", json=body, headers=self.headers, timeout=timeout
            )
        except httpx.HTTPError as exc:
            self.error = exc
        self.ended = time.monotonic() - self._start

    def wait(self) -> httpx.Response:
        self._thread.join(40)
        assert self.answer is not None, f"no answer: {self.error!r}"
        return self.answer


def held(stack: Stack, priority: str = "0") -> float:
    return metric(
        stack, "extproc_flow_queue_requests", f'model="{MODEL}",priority="{priority}"', absent=0
    )


def fill(stack: Stack, sim: SimPods, delay_s: float = DELAY_S) -> list[Sent]:
    """Every pod busy for ``delay_s``: one request each (least-request spreads them)."""
    for pod in sim.pods:
        sim.set_faults(pod.name, delay_s=delay_s)
    before = decisions(stack)
    fillers = [Sent(stack) for _ in sim.pods]
    wait_until(lambda: decisions(stack) == before + len(fillers), 5, what="fillers not routed")
    return fillers


def decisions(stack: Stack) -> float:
    return metric(stack, "extproc_route_decisions_total", f'model="{MODEL}"', absent=0)


def test_a_held_request_is_routed_when_a_pod_frees(flow_stack: Stack, sim: SimPods) -> None:
    capacity = metric(
        flow_stack, "extproc_flow_dispatched_total", 'priority="0",reason="capacity"', absent=0
    )
    fillers = fill(flow_stack, sim)
    late = Sent(flow_stack)
    wait_until(lambda: held(flow_stack) == 1, 5, what="the fifth request is not held")
    assert late.answer is None
    assert all(f.wait().status_code == 200 for f in fillers)
    assert late.wait().status_code == 200
    assert late.ended >= DELAY_S * 1.5  # waited for a filler, then was served
    assert (
        metric(flow_stack, "extproc_flow_dispatched_total", 'priority="0",reason="capacity"')
        == capacity + 1
    )
    assert held(flow_stack) == 0


def test_a_higher_band_is_served_before_a_lower_one(flow_stack: Stack, sim: SimPods) -> None:
    fill(flow_stack, sim)
    standard = [Sent(flow_stack) for _ in sim.pods]
    wait_until(lambda: held(flow_stack) == len(sim.pods), 5)
    critical = Sent(flow_stack, "critical")
    wait_until(lambda: held(flow_stack, "100") == 1, 5)
    assert critical.wait().status_code == 200
    assert all(s.wait().status_code == 200 for s in standard)
    ends = sorted(s.ended for s in standard)
    # The critical request, sent last, took the first freed slot: served in the second
    # wave, while one standard request waited for a third.
    assert critical.ended < 2.7 * DELAY_S
    assert ends[-1] > critical.ended + 0.5 * DELAY_S


def test_a_noisy_tenant_does_not_hold_back_the_others(flow_stack: Stack, sim: SimPods) -> None:
    fill(flow_stack, sim)
    noisy = [Sent(flow_stack, tenant="noisy") for _ in range(2 * len(sim.pods))]
    wait_until(lambda: held(flow_stack) == len(noisy), 5)
    quiet = [Sent(flow_stack, tenant=name) for name in ("a", "b")]
    wait_until(lambda: held(flow_stack) == len(noisy) + 2, 5)
    assert all(q.wait().status_code == 200 for q in quiet)
    assert all(n.wait().status_code == 200 for n in noisy)
    # First come first served would serve the quiet tenants in the third wave; fair
    # queueing serves them in the second, with the noisy tenant's first requests.
    assert max(q.ended for q in quiet) < 2.7 * DELAY_S
    assert max(n.ended for n in noisy) > 2.7 * DELAY_S


def test_sheddable_requests_are_refused_at_once_while_saturated(
    flow_stack: Stack, sim: SimPods
) -> None:
    fillers = fill(flow_stack, sim)
    shed = Sent(flow_stack, "sheddable").wait()
    assert shed.status_code == 429
    assert shed.headers["retry-after"] == "2"
    assert shed.json()["error"]["code"] == "shed"
    assert shed.json()["error"]["type"] == "rate_limit_error"
    assert all(f.wait().status_code == 200 for f in fillers)


def test_a_request_whose_time_to_live_ends_gets_429_with_retry_after(
    flow_stack: Stack, sim: SimPods
) -> None:
    fillers = fill(flow_stack, sim, delay_s=3.0)
    answer = Sent(flow_stack, "interactive").wait()  # priority 1: a 1.5 s time to live
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "queue_timeout"
    assert answer.headers["retry-after"] == "2"
    assert all(f.wait().status_code == 200 for f in fillers)


def test_a_client_that_leaves_while_held_frees_its_place(flow_stack: Stack, sim: SimPods) -> None:
    cancelled = metric(flow_stack, "extproc_flow_cancelled_total", 'priority="0"', absent=0)
    fillers = fill(flow_stack, sim, delay_s=2.0)
    leaving = Sent(flow_stack, timeout=0.5)  # gives up while held
    wait_until(lambda: leaving.ended > 0, 5)
    assert isinstance(leaving.error, httpx.TimeoutException)
    wait_until(lambda: held(flow_stack) == 0, 3, what="the place was not freed")
    assert metric(flow_stack, "extproc_flow_cancelled_total", 'priority="0"') == cancelled + 1
    before = decisions(flow_stack)
    assert all(f.wait().status_code == 200 for f in fillers)
    time.sleep(0.3)
    assert decisions(flow_stack) == before  # never routed


@pytest.mark.parametrize(
    ("objective", "reason"), [("gold", "unknown"), ("Not A Name!", "malformed")]
)
def test_an_unknown_or_malformed_objective_gets_the_default_priority(
    flow_stack: Stack, objective: str, reason: str
) -> None:
    counted = metric(
        flow_stack, "extproc_flow_default_priority_total", f'reason="{reason}"', absent=0
    )
    answer = Sent(flow_stack, objective).wait()
    assert answer.status_code == 200
    assert (
        metric(flow_stack, "extproc_flow_default_priority_total", f'reason="{reason}"')
        == counted + 1
    )


def test_envoys_message_timeout_does_not_end_a_hold(sim: SimPods) -> None:
    """Envoy's message timeout (1 s here) is shorter than the hold (about 2 s): extproc's
    override_message_timeout keeps Envoy waiting, so the request is served, not a 504."""
    with run_stack(
        sim.as_pods(), config=CONFIG, extproc_args=NO_SCRAPING, message_timeout_s=1.0
    ) as stack:
        fillers = fill(stack, sim, delay_s=2.0)
        late = Sent(stack)
        answer = late.wait()
        assert answer.status_code == 200 and late.ended > 1.5
        assert all(f.wait().status_code == 200 for f in fillers)


def test_a_drain_routes_every_held_request(sim: SimPods) -> None:
    """The drain (1 s here) ends before any pod frees: the held requests are routed at
    its start, not left to fail when extproc stops."""
    drain = ["--drain-s", "1"]
    with run_stack(sim.as_pods(), config=CONFIG, extproc_args=NO_SCRAPING + drain) as stack:
        fillers = fill(stack, sim, delay_s=3.0)
        waiting = [Sent(stack) for _ in range(3)]
        wait_until(lambda: held(stack) == 3, 5)
        stack.kill_extproc(signal.SIGTERM)
        assert all(w.wait().status_code == 200 for w in waiting)
        assert all(f.wait().status_code == 200 for f in fillers)
