"""extproc itself failing under load, behind real Envoy, with ``failure_mode_allow`` false
(the default: Envoy answers 500 while extproc is down, 504 past the message timeout) and
true (Envoy sends such requests to a round-robin pod): killed and restarted, SIGTERM with
streams in flight, a scheduler slower than the message timeout."""

from __future__ import annotations

import re
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from e2e.slow_scheduler import marker
from e2e.support import MODEL, PREFIX_CONFIG, RECORDED, background_load, metric, unique_prefix
from extproc.sim.launch import SimPods, Stack, run_stack
from testkit.waiting import wait_until

API = "/v1/completions"
ABANDONED = ("extproc_completions_total", 'outcome="abandoned"')
PENDING = ("extproc_pending_completions", "")
DRAIN_S = 8.0  # ends as soon as nothing is pending; long enough for a loaded CI machine
# Envoy's message timeout here, shorter than the default so the slow-scheduler case is quick,
# and the scheduler's delay in that case, well past it.
MESSAGE_TIMEOUT_S = 1.0
SLOW_SCHEDULE_S = 2.5


@pytest.fixture(scope="module", params=[False, True], ids=["fail-closed", "fail-open"])
def lifecycle_stack(request: pytest.FixtureRequest, sim: SimPods) -> Iterator[Stack]:
    with run_stack(
        sim.as_pods(),
        config=PREFIX_CONFIG,
        failure_mode_allow=request.param,
        extproc_args=["--drain-s", str(DRAIN_S)],
        extproc_command=(sys.executable, "-m", "e2e.slow_scheduler"),
        message_timeout_s=MESSAGE_TIMEOUT_S,
    ) as stack:
        stack.fail_open = request.param  # type: ignore[attr-defined]
        yield stack


def fail_open(stack: Stack) -> bool:
    return bool(stack.fail_open)  # type: ignore[attr-defined]


def test_extproc_killed_and_restarted_under_load(lifecycle_stack: Stack) -> None:
    stack = lifecycle_stack
    with background_load(stack.url) as load:
        load.wait_for_answers(20)
        killed_at = time.monotonic()
        stack.kill_extproc()  # SIGKILL: no drain
        load.wait_for_answers(20, since=killed_at)
        down = load.statuses(since=killed_at)
        stack.restart_extproc()
        wait_until(lambda: load.statuses(since=time.monotonic() - 1)[200] >= 10, 15)
        settled_at = time.monotonic()
        load.wait_for_answers(20, since=settled_at)
        after = load.statuses(since=settled_at)
    assert set(after) == {200}, after  # Envoy reconnected by itself
    everything = load.statuses()
    if fail_open(stack):
        assert set(everything) == {200}, everything  # round robin while extproc was down
    else:
        assert down[500] > 0 and set(everything) <= {200, 500}, everything
    assert 0 not in everything  # no connection errors either way
    print(f"extproc killed under load ({'fail-open' if fail_open(stack) else 'fail-closed'}): "
          f"{everything.total()} requests, statuses {dict(everything)}; while down {dict(down)}")  # fmt: skip
    # the restarted extproc records and routes with affinity again
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        prefix = unique_prefix()
        before = metric(stack, *RECORDED)
        first = client.post(API, json={"model": MODEL, "prompt": prefix + "a", "max_tokens": 1})
        assert first.status_code == 200
        wait_until(lambda: metric(stack, *RECORDED) == before + 1)
        for question in "bcd":
            again = client.post(
                API, json={"model": MODEL, "prompt": prefix + question, "max_tokens": 1}
            )
            assert again.status_code == 200
            assert again.headers["x-sim-pod"] == first.headers["x-sim-pod"]


def stream_to_the_end(url: str, prompt: str) -> tuple[int, list[str]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 120, "stream": True}
    with (
        httpx.Client(base_url=url, timeout=30) as client,
        client.stream("POST", API, json=body) as resp,
    ):
        return resp.status_code, [line for line in resp.iter_lines() if line.startswith("data: ")]


def test_sigterm_lets_streams_in_flight_finish_and_be_recorded(lifecycle_stack: Stack) -> None:
    stack = lifecycle_stack
    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream_to_the_end, stack.url, f"drain {i} " * 30) for i in range(6)]
        wait_until(lambda: metric(stack, *PENDING) >= 6, timeout_s=10)
        stack.extproc.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: "new ext_proc streams are refused" in stack.extproc.log_tail(), 10)
        during = httpx.post(
            f"{stack.url}{API}",
            json={"model": MODEL, "prompt": "during the drain", "max_tokens": 1},
            timeout=30,
        )
        results = [s.result(timeout=30) for s in streams]
    for status, lines in results:
        assert status == 200 and lines[-1] == "data: [DONE]" and len(lines) > 100
    assert during.status_code == (200 if fail_open(stack) else 500)
    assert stack.extproc.popen.wait(DRAIN_S + 10) == 0
    # Envoy still sends the access log while extproc drains: the streams are recorded,
    # and extproc stops as soon as nothing is pending (its metrics go with it)
    drained = re.search(
        r"drained: (\d+) routed requests were in flight, (\d+) recorded since, (\d+) left",
        stack.extproc.log_tail(),
    )
    assert drained, stack.extproc.log_tail()
    in_flight, recorded, left = map(int, drained.groups())
    assert in_flight >= 6 and recorded >= 6 and left == 0
    stack.restart_extproc()
    wait_until(
        lambda: (
            httpx.post(
                f"{stack.url}{API}", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
            ).status_code
            == 200
        ),
        timeout_s=10,
    )


def test_a_scheduler_slower_than_the_message_timeout(lifecycle_stack: Stack) -> None:
    """Envoy's message timeout (1 s here) passes while extproc schedules: 504, or a
    round-robin pod when failing open; extproc abandons the late route and routes the
    next request as usual. (Routing runs on the loop thread: a request arriving during
    the slow one waits for it.)"""
    stack = lifecycle_stack
    abandoned = metric(stack, *ABANDONED)
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        slow = {"model": MODEL, "prompt": marker(SLOW_SCHEDULE_S) + " slow", "max_tokens": 1}
        resp = client.post(API, json=slow)
        wait_until(lambda: metric(stack, *ABANDONED) == abandoned + 1, timeout_s=15)
        quick = client.post(API, json={"model": MODEL, "prompt": "not slow", "max_tokens": 1})
        assert quick.status_code == 200
    if fail_open(stack):
        assert resp.status_code == 200 and resp.headers["x-sim-pod"]
    else:
        assert resp.status_code == 504
    wait_until(lambda: metric(stack, *PENDING) == 0, timeout_s=5)
