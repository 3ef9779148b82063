"""Pods failing behind real Envoy: killed mid-stream and under load, back with an empty
cache, slow, answering 5xx, their /metrics down or garbage, removed from the pods file;
the pods file turned invalid. Requests with a retry available succeed on the next-best
pod, nothing is recorded for a pod that did not complete a response, and a pod gone
from discovery leaves the index.

The four shared simulated pods serve with a fifth, the victim, in a process of its own
so that it can really be killed (SIGKILL) and started again on its port.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager

import httpx
import pytest

from e2e.support import (
    ENTRIES,
    FAILED,
    MODEL,
    PREFIX_CONFIG,
    RECORDED,
    background_load,
    body_for,
    metric,
    send_and_wait_recorded,
    unique_prefix,
)
from extproc.pods import Pod, PodId
from extproc.sim.launch import SimPods, Stack, free_port, run_stack, spawn_sim_pods, write_pods_file
from testkit.waiting import wait_until

API = "/v1/completions"
READY = ("extproc_pods_ready", "")
KNOWN = ("extproc_pods_known", "")
VICTIM = "victim-0"


@pytest.fixture(scope="module")
def victim_port() -> int:
    """The victim's port, its address in the pods file and in Envoy's cluster, so it
    comes back on it after each kill. ``free_port`` picks below the ephemeral range:
    nothing binding port 0 (servers, clients' outgoing connections) can take it meanwhile."""
    return free_port()


@pytest.fixture(scope="module")
def all_pods(sim: SimPods, victim_port: int) -> list[Pod]:
    victim = Pod(PodId("default", VICTIM), f"127.0.0.1:{victim_port}", frozenset({MODEL}))
    return [*sim.as_pods(), victim]


@pytest.fixture(scope="module")
def chaos_stack(all_pods: list[Pod]) -> Iterator[Stack]:
    with run_stack(all_pods, config=PREFIX_CONFIG) as stack:
        yield stack


def start_victim(port: int) -> AbstractContextManager[SimPods]:
    return spawn_sim_pods(1, port=port, args=["--model", MODEL, "--name-prefix", "victim"])


@pytest.fixture
def victim(chaos_stack: Stack, victim_port: int, all_pods: list[Pod]) -> Iterator[SimPods]:
    """The victim running, and extproc seeing all five pods ready."""
    write_pods_file(all_pods, chaos_stack.pods_file)
    with start_victim(victim_port) as pods:
        wait_until(lambda: metric(chaos_stack, *READY) == 5, timeout_s=10)
        yield pods


def kill(pods: SimPods) -> None:
    assert pods.pid is not None
    os.kill(pods.pid, signal.SIGKILL)


def prefix_owned_by(stack: Stack, client: httpx.Client, pod: str) -> str:
    """A fresh prefix recorded for ``pod`` (fresh prefixes tie: the pick is random)."""
    for _ in range(60):
        prefix = unique_prefix()
        if send_and_wait_recorded(stack, client, API, body_for(API, prefix, "q")) == pod:
            return prefix
    raise AssertionError(f"no fresh prefix landed on {pod} in 60 tries")


def test_a_pod_killed_mid_stream_records_nothing(chaos_stack: Stack, victim: SimPods) -> None:
    with httpx.Client(base_url=chaos_stack.url, timeout=30) as client:
        prefix = prefix_owned_by(chaos_stack, client, VICTIM)
        entries, failed = metric(chaos_stack, *ENTRIES), metric(chaos_stack, *FAILED)
        body = body_for(API, prefix, "stream", stream=True, max_tokens=200)
        lines: list[str] = []
        try:
            with client.stream("POST", API, json=body) as resp:
                assert resp.headers["x-sim-pod"] == VICTIM
                for line in resp.iter_lines():
                    lines.append(line)
                    if len(lines) == 3:
                        kill(victim)
        except httpx.HTTPError:
            pass  # the cut may surface as a transport error
        assert "data: [DONE]" not in lines
        wait_until(lambda: metric(chaos_stack, *FAILED) == failed + 1)
        assert metric(chaos_stack, *ENTRIES) == entries
        # and the next request with that prefix is served elsewhere, at once
        resp = client.post(API, json=body_for(API, prefix, "again"))
        assert resp.status_code == 200 and resp.headers["x-sim-pod"] != VICTIM


def test_a_pod_back_with_an_empty_cache_serves_its_prefixes_again(
    chaos_stack: Stack, victim: SimPods, victim_port: int
) -> None:
    with httpx.Client(base_url=chaos_stack.url, timeout=30) as client:
        prefix = prefix_owned_by(chaos_stack, client, VICTIM)
        kill(victim)
        wait_until(lambda: metric(chaos_stack, *READY) == 4, timeout_s=5)
        with start_victim(victim_port) as back:
            wait_until(lambda: metric(chaos_stack, *READY) == 5, timeout_s=10)
            for i in range(2):  # the index still says it holds the prefix; its cache is empty
                resp = client.post(API, json=body_for(API, prefix, f"back {i}"))
                assert resp.status_code == 200 and resp.headers["x-sim-pod"] == VICTIM
            first, second = back.stats(VICTIM)["recent"][-2:]
            assert first["cached_tokens"] == 0 and second["cached_tokens"] > 0


def test_a_pod_killed_under_load_is_retried_on_the_next_best(
    chaos_stack: Stack, victim: SimPods
) -> None:
    with httpx.Client(base_url=chaos_stack.url, timeout=30) as client:
        prefix = prefix_owned_by(chaos_stack, client, VICTIM)
    with background_load(chaos_stack.url, lambda i: body_for(API, prefix, f"load {i}")) as load:
        load.wait_for_answers(30)
        killed_at = time.monotonic()
        kill(victim)
        load.wait_for_answers(60, since=killed_at)
    statuses = load.statuses()
    assert set(statuses) == {200}, statuses  # a reset or refused connection is retried
    after = [pod for t, _, pod in load.outcomes if t > killed_at + 0.1]
    assert after and VICTIM not in after
    wait_until(lambda: metric(chaos_stack, *READY) == 4, timeout_s=5)
    print(f"victim killed under load: {statuses.total()} requests, statuses {dict(statuses)}")


def test_a_pod_removed_from_the_pods_file_leaves_the_index(
    chaos_stack: Stack, victim: SimPods, all_pods: list[Pod]
) -> None:
    with httpx.Client(base_url=chaos_stack.url, timeout=30) as client:
        prefix_owned_by(chaos_stack, client, VICTIM)
        entries = metric(chaos_stack, *ENTRIES)
        write_pods_file(all_pods[:-1], chaos_stack.pods_file)
        wait_until(lambda: metric(chaos_stack, *KNOWN) == 4, timeout_s=5)
        assert metric(chaos_stack, *ENTRIES) <= entries - 19  # its blocks, at least these 19
        for i in range(10):
            resp = client.post(API, json=body_for(API, unique_prefix(), str(i)))
            assert resp.status_code == 200 and resp.headers["x-sim-pod"] != VICTIM


def test_an_invalid_pods_file_keeps_the_last_good_list_and_says_why(
    chaos_stack: Stack, victim: SimPods, all_pods: list[Pod]
) -> None:
    chaos_stack.pods_file.write_text("pods: [\n  - {name: broken\n")
    expected = f"{chaos_stack.pods_file}: not valid YAML"
    wait_until(lambda: expected in chaos_stack.extproc.log_tail(200_000), timeout_s=5)
    assert "keeping the last good 5 pods" in chaos_stack.extproc.log_tail(200_000)
    assert metric(chaos_stack, *KNOWN) == 5
    with httpx.Client(base_url=chaos_stack.url, timeout=30) as client:
        assert client.post(API, json=body_for(API, unique_prefix(), "q")).status_code == 200
    write_pods_file(all_pods, chaos_stack.pods_file)


def test_a_slow_pod_finishes_and_is_recorded(chaos_stack: Stack, victim: SimPods) -> None:
    with httpx.Client(base_url=chaos_stack.url, timeout=30) as client:
        prefix = prefix_owned_by(chaos_stack, client, VICTIM)
        victim.set_faults(VICTIM, delay_s=1.0)
        recorded = metric(chaos_stack, *RECORDED)
        with ThreadPoolExecutor(6) as pool:
            answers = list(
                pool.map(
                    lambda i: client.post(API, json=body_for(API, prefix, f"slow {i}")), range(6)
                )
            )
    assert all(a.status_code == 200 for a in answers)
    wait_until(lambda: metric(chaos_stack, *RECORDED) == recorded + 6)
    wait_until(lambda: metric(chaos_stack, "extproc_pending_completions") == 0)


def test_pods_answering_5xx_are_retried_and_never_recorded(
    chaos_stack: Stack, victim: SimPods, sim: SimPods
) -> None:
    """Two of five pods fail (500 always, 502 every second request); three are listed."""
    victim.set_faults(VICTIM, error_rate=1.0, error_status=500)
    sim.set_faults(0, error_rate=0.5, error_status=502)
    retries = metric(chaos_stack, "extproc_retries_observed_total")
    prefixes = [unique_prefix() for _ in range(40)]
    with (
        httpx.Client(base_url=chaos_stack.url, timeout=30) as client,
        ThreadPoolExecutor(8) as pool,
    ):
        answers = list(pool.map(lambda p: client.post(API, json=body_for(API, p, "q")), prefixes))
        assert all(a.status_code == 200 for a in answers)
        assert VICTIM not in {a.headers["x-sim-pod"] for a in answers}
        assert metric(chaos_stack, "extproc_retries_observed_total") > retries
        victim.clear_faults(VICTIM)
        sim.clear_faults(0)
        # each prefix was recorded for the pod that served it, never for a failed attempt
        for prefix, first in zip(prefixes[:10], answers):
            resp = client.post(API, json=body_for(API, prefix, "again"))
            assert resp.headers["x-sim-pod"] == first.headers["x-sim-pod"]


@pytest.mark.parametrize(("mode", "reason"), [("error", "http_status"), ("garbage", "parse")])
def test_a_pod_whose_metrics_are_down_or_garbage_is_left_out_until_they_return(
    chaos_stack: Stack, victim: SimPods, mode: str, reason: str
) -> None:
    errors = ("extproc_scrape_errors_total", f'pod="default/{VICTIM}",reason="{reason}"')
    before = metric(chaos_stack, *errors, absent=0.0)  # the pod's first error makes it
    victim.set_faults(VICTIM, metrics=mode)
    wait_until(lambda: metric(chaos_stack, *READY) == 4, timeout_s=5)  # stale after 2 s
    assert metric(chaos_stack, *errors) > before
    with httpx.Client(base_url=chaos_stack.url, timeout=30) as client:
        for i in range(10):
            resp = client.post(API, json=body_for(API, unique_prefix(), str(i)))
            assert resp.status_code == 200 and resp.headers["x-sim-pod"] != VICTIM
    victim.clear_faults(VICTIM)
    wait_until(lambda: metric(chaos_stack, *READY) == 5, timeout_s=5)
