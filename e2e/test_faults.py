"""Through real Envoy: retries walk the list; only successful responses are recorded."""

from __future__ import annotations

import httpx

from e2e.support import (
    ENTRIES,
    FAILED,
    MODEL,
    NUM_PODS,
    RECORDED,
    body_for,
    metric,
    send_and_wait_recorded,
    served_by,
    unique_prefix,
)
from extproc.sim.launch import SimPods, Stack
from testkit.waiting import wait_until

API = "/v1/completions"


def test_streaming_records_only_after_the_stream_ends(stack: Stack, sim: SimPods) -> None:
    prefix = unique_prefix()
    body = body_for(API, prefix, "stream please", stream=True, max_tokens=30)
    before = metric(stack, *RECORDED)
    with (
        httpx.Client(base_url=stack.url, timeout=30) as client,
        client.stream("POST", API, json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert first != "data: [DONE]"
        assert metric(stack, *RECORDED) == before  # still streaming: nothing recorded
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    wait_until(lambda: metric(stack, *RECORDED) == before + 1)


def test_a_503_pod_is_retried_on_the_next_best_which_is_recorded(
    stack: Stack, client: httpx.Client, sim: SimPods
) -> None:
    prefix = unique_prefix()
    owner = send_and_wait_recorded(stack, client, API, body_for(API, prefix, "q"))
    entries = metric(stack, *ENTRIES)
    sim.set_faults(owner, error_rate=1.0, error_status=503)
    served = send_and_wait_recorded(stack, client, API, body_for(API, prefix, "q"))
    assert served != owner
    # the retried pod now holds the prompt's 19 blocks too; the failed attempt added nothing
    assert metric(stack, *ENTRIES) == entries + 19


def test_a_pod_refusing_connections_is_skipped(
    stack: Stack, client: httpx.Client, sim: SimPods
) -> None:
    prefix = unique_prefix()
    owner = send_and_wait_recorded(stack, client, API, body_for(API, prefix, "q"))
    sim.set_faults(owner, refuse_connections=True)
    for _ in range(3):
        assert served_by(client.post(API, json=body_for(API, prefix, "q"))) != owner


def test_a_pod_dying_mid_stream_records_nothing(stack: Stack, sim: SimPods) -> None:
    prefix = unique_prefix()
    for pod in sim.pods:
        sim.set_faults(pod.name, die_mid_stream_after_chunks=2)
    entries, failed = metric(stack, *ENTRIES), metric(stack, *FAILED)
    body = body_for(API, prefix, "q", stream=True, max_tokens=20)
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        try:
            with client.stream("POST", API, json=body) as resp:
                lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
            assert "data: [DONE]" not in lines
        except httpx.HTTPError:
            pass  # the cut may also surface as a transport error
    wait_until(lambda: metric(stack, *FAILED) == failed + 1)
    assert metric(stack, *ENTRIES) == entries


def test_extproc_killed_and_restarted_envoy_recovers(stack: Stack, client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "after the restart", "max_tokens": 2}
    stack.kill_extproc()
    assert client.post(API, json=body).status_code == 500  # failure_mode_allow false
    stack.restart_extproc()
    wait_until(lambda: client.post(API, json=body).status_code == 200, timeout_s=10)
    # a new process starts with an empty index: only the one-block prompt above, per pod
    assert metric(stack, *ENTRIES) <= NUM_PODS
