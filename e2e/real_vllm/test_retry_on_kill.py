"""A real vLLM pod, the first of extproc's list, killed with requests in flight.

Requests for a prefix the pod owns (so it is their pick) are all generating or queued on
it when it is SIGKILLed. Envoy sees the resets before any response header and retries
each on the next pod of the list: every request succeeds, on the others, and every
success is recorded for the pod that served it (the index gains the prefix's blocks on
the pod that took over; recorded for the dead pick, it would gain one block a request).
A pod refusing connections is the same retry (e2e/test_retry_order.py, test_chaos.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from e2e.real_vllm.kills import live_pods
from e2e.real_vllm.pods import VllmPod, metric_sum
from e2e.real_vllm.support import chat, delta, long_prefix, send_recorded, snapshot
from e2e.support import RECORDED, metric
from extproc.sim.launch import Stack
from testkit.waiting import wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.real_vllm,
    pytest.mark.kills_pod,
    pytest.mark.timeout(900),
]

ENTRIES = ("kthena_router_prefix_cache_entries", "")
IN_FLIGHT = 4  # generating or queued on the pod when it dies


def test_requests_in_flight_on_a_killed_pod_are_retried_and_recorded_where_served(
    vllm_stack: Stack, vllm_pods: list[VllmPod], client: httpx.Client
) -> None:
    alive = live_pods(vllm_stack, vllm_pods)  # whichever killing test ran first
    prefix = long_prefix()
    before = snapshot(alive)
    send_recorded(vllm_stack, client, chat(prefix, "warm up"))
    owner = alive[delta(before, snapshot(alive), "vllm:request_success_total").index(1.0)]
    others = [p for p in alive if p is not owner]
    others_before = snapshot(others)
    recorded, entries = metric(vllm_stack, *RECORDED), metric(vllm_stack, *ENTRIES)

    def ask(i: int) -> int:
        body = chat(prefix, f"question {i}", max_tokens=120)
        return client.post("/v1/chat/completions", json=body).status_code

    def on_owner() -> float:
        page = owner.metrics_text()
        return metric_sum(page, "vllm:num_requests_running") + metric_sum(
            page, "vllm:num_requests_waiting"
        )

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        answers = [pool.submit(ask, i) for i in range(IN_FLIGHT)]
        wait_until(lambda: on_owner() >= IN_FLIGHT, timeout_s=60, what="not all on the owner")
        owner.kill()
        statuses = [a.result(timeout=300) for a in answers]
    assert statuses == [200] * IN_FLIGHT
    # none had finished on the owner: each was retried and served by another pod
    served_by_others = delta(others_before, snapshot(others), "vllm:request_success_total")
    assert sum(served_by_others) == IN_FLIGHT, served_by_others
    wait_until(lambda: metric(vllm_stack, *RECORDED) == recorded + IN_FLIGHT, 30)
    # Recorded for the dead pick, each request would add only its own last block (the
    # prefix's 21 are the pick's already): one entry a request. Recorded where served,
    # the pod that took over gained the prefix's blocks.
    assert metric(vllm_stack, *ENTRIES) - entries > IN_FLIGHT
