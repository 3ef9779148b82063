"""Through real Envoy, with the shipped default (estimated-ttft): a pick's prompt counts as
arriving at its pod at once, so a second request with the same new prefix follows it
before the first response ends; the credit goes when the request ends, however it ends
(success, failure, a retry another pod served, Envoy's message timeout). Each test of an
end first sees the credit given (``post_credited``): a credit never given leaves none too."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import httpx
import pytest

from e2e.slow_after_pick import after_pick
from e2e.slow_scheduler import marker
from e2e.support import MODEL, RECORDED, metric, unique_prefix
from extproc.sim.launch import SimPods, Stack, run_stack
from testkit.waiting import wait_until

ARRIVING = ("extproc_estimated_ttft_arriving_requests", "")
ENTRIES = ("extproc_estimated_ttft_entries", "")
FAILED = ("extproc_completions_total", 'outcome="failed"')
ABANDONED = ("extproc_completions_total", 'outcome="abandoned"')
RETRIES = ("extproc_retries_observed_total", "")
MAX_TRIES = 30  # fresh prefixes tie: the pick is random, a failing one comes up soon
MESSAGE_TIMEOUT_S = 1.0  # Envoy's, in the timeout case; the route there takes longer
IN_FLIGHT_S = 2.0  # how long the pods hold a request while a test looks at its credit


@pytest.fixture(scope="module")
def default_stack(sim: SimPods) -> Iterator[Stack]:
    with run_stack(sim.as_pods()) as running:  # no config: the embedded default
        yield running


def post(url: str, prompt: str, out: dict[str, httpx.Response], key: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    out[key] = httpx.post(url + "/v1/completions", json=body, timeout=30)


def post_credited(stack: Stack, prompt: str, out: dict[str, httpx.Response], key: str) -> None:
    """``post`` the request, which must be the only one in flight, and see its pick
    credited before its end (the control: without it "no credit after" proves nothing)."""
    assert metric(stack, *ARRIVING) == 0, "a credit left from before"
    request = threading.Thread(target=post, args=(stack.url, prompt, out, key))
    request.start()
    try:
        wait_until(lambda: metric(stack, *ARRIVING) == 1, 10, what="no credit at the pick")
    finally:
        request.join(30)
    assert not request.is_alive(), "the request never ended"


def test_a_second_request_follows_the_first_before_it_ends(
    default_stack: Stack, sim: SimPods
) -> None:
    for pod in sim.pods:
        sim.set_faults(pod.name, delay_s=2.0)  # the first stays in flight for 2 s
    prefix = unique_prefix()
    recorded = metric(default_stack, *RECORDED)
    answers: dict[str, httpx.Response] = {}
    first = threading.Thread(target=post, args=(default_stack.url, prefix + "q1", answers, "1"))
    first.start()
    wait_until(lambda: metric(default_stack, *ARRIVING) >= 1, 10, what="no credit at pick")
    post(default_stack.url, prefix + "q2", answers, "2")
    first.join(30)
    assert answers["1"].status_code == answers["2"].status_code == 200
    assert answers["1"].headers["x-sim-pod"] == answers["2"].headers["x-sim-pod"]
    wait_until(lambda: metric(default_stack, *ARRIVING) == 0, 10, what="credit left behind")
    wait_until(lambda: metric(default_stack, *RECORDED) >= recorded + 2, 10)


def test_a_failed_request_leaves_no_credit_and_no_record(
    default_stack: Stack, sim: SimPods
) -> None:
    for pod in sim.pods:  # each answers 500, after a while in flight
        sim.set_faults(pod.name, delay_s=IN_FLIGHT_S, error_rate=1.0, error_status=500)
    entries = metric(default_stack, *ENTRIES)
    failed = metric(default_stack, *FAILED)
    answers: dict[str, httpx.Response] = {}
    post_credited(default_stack, unique_prefix() + "q", answers, "only")
    assert answers["only"].status_code >= 500
    wait_until(lambda: metric(default_stack, *FAILED) > failed, 10)
    assert metric(default_stack, *ARRIVING) == 0
    assert metric(default_stack, *ENTRIES) == entries


def test_a_retry_served_elsewhere_leaves_no_credit_and_records_the_server(
    default_stack: Stack, sim: SimPods
) -> None:
    """Every pod but one answers 503: a request picked for a failing pod and served by the
    healthy one after Envoy's retry ends with no credit anywhere, recorded for the healthy
    pod only, so the prefix's next request goes there once every pod is healthy again."""
    healthy = sim.pods[0].name
    sim.set_faults(healthy, delay_s=IN_FLIGHT_S)  # every pick stays in flight a while
    for pod in sim.pods[1:]:
        sim.set_faults(pod.name, delay_s=IN_FLIGHT_S, error_rate=1.0, error_status=503)
    answers: dict[str, httpx.Response] = {}
    for _ in range(MAX_TRIES):
        ended = metric(default_stack, *RECORDED) + metric(default_stack, *FAILED)
        retries = metric(default_stack, *RETRIES)
        prefix = unique_prefix()
        post_credited(default_stack, prefix + "q", answers, "try")
        wait_until(  # called within this iteration, so ``ended`` is this iteration's
            lambda: metric(default_stack, *RECORDED) + metric(default_stack, *FAILED) > ended,  # noqa: B023
            10,
            what="the request's end never reached extproc",
        )
        if answers["try"].status_code == 200 and metric(default_stack, *RETRIES) > retries:
            break  # a failing pod was picked, the healthy one served
    else:
        pytest.fail(f"no request was retried onto the healthy pod in {MAX_TRIES}")
    assert answers["try"].headers["x-sim-pod"] == healthy
    assert metric(default_stack, *ARRIVING) == 0
    for pod in sim.pods:
        sim.clear_faults(pod.name)
    post(default_stack.url, prefix + "again", answers, "next")
    assert answers["next"].status_code == 200
    assert answers["next"].headers["x-sim-pod"] == healthy
    wait_until(lambda: metric(default_stack, *ARRIVING) == 0, 10)


@pytest.fixture(scope="module")
def slow_stack(sim: SimPods) -> Iterator[Stack]:
    """The shipped default, behind an Envoy that waits 1 s for extproc's answer; a prompt
    with ``e2e.slow_scheduler``'s marker takes longer to schedule, one with
    ``e2e.slow_after_pick``'s is answered that long after its pick's credit."""
    with run_stack(
        sim.as_pods(),
        extproc_command=(sys.executable, "-m", "e2e.slow_after_pick"),
        message_timeout_s=MESSAGE_TIMEOUT_S,
    ) as running:
        yield running


@pytest.mark.parametrize(
    ("schedule_s", "after_pick_s"),
    [
        pytest.param(0.0, 2.5, id="credited-before-envoy-stopped-waiting"),
        pytest.param(1.5, 1.5, id="credited-after-envoy-stopped-waiting"),
    ],
)
def test_a_route_envoy_stopped_waiting_for_leaves_no_credit(
    slow_stack: Stack, schedule_s: float, after_pick_s: float
) -> None:
    """Envoy's message timeout passes while extproc routes: the request is answered 504,
    extproc abandons the route it made, and with it the credit it was seen to give
    (before Envoy stopped waiting, or after); nothing is recorded."""
    abandoned = metric(slow_stack, *ABANDONED)
    entries = metric(slow_stack, *ENTRIES)
    answers: dict[str, httpx.Response] = {}
    prompt = marker(schedule_s) + after_pick(after_pick_s) + unique_prefix()
    post_credited(slow_stack, prompt, answers, "slow")
    assert answers["slow"].status_code == 504
    wait_until(lambda: metric(slow_stack, *ABANDONED) == abandoned + 1, 15)
    assert metric(slow_stack, *ARRIVING) == 0
    assert metric(slow_stack, *ENTRIES) == entries
