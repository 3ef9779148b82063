"""A real vLLM pod killed mid-run: the others keep serving, nothing is recorded for it.

extproc's scraper finds the dead pod's ``/metrics`` unreachable and stops listing it
(``extproc_pods_ready`` drops); requests routed to it before that are retried by Envoy on
the next pod of the list, and the access log names the pod that really served, so every
success is recorded there. The stream cut by the kill is reported ``failed`` and
recorded for nobody.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from e2e.real_vllm.kills import READY, live_pods
from e2e.real_vllm.pods import VllmPod
from e2e.real_vllm.support import (
    chat,
    delta,
    long_prefix,
    send_recorded,
    snapshot,
)
from e2e.support import RECORDED, metric
from extproc.sim.launch import Stack
from testkit.waiting import wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.real_vllm,
    pytest.mark.kills_pod,
    pytest.mark.timeout(900),
]

FAILED = ("extproc_completions_total", 'outcome="failed"')
NUM_AFTER = 16


def test_killing_a_pod_mid_stream_others_serve_and_nothing_is_recorded_for_it(
    vllm_stack: Stack, vllm_pods: list[VllmPod], client: httpx.Client
) -> None:
    alive = live_pods(vllm_stack, vllm_pods)  # whichever killing test ran first
    prefix = long_prefix()
    before = snapshot(alive)
    send_recorded(vllm_stack, client, chat(prefix, "warm up"))
    owner = alive[delta(before, snapshot(alive), "vllm:request_success_total").index(1.0)]
    live = [p for p in alive if p is not owner]
    failed, recorded = metric(vllm_stack, *FAILED), metric(vllm_stack, *RECORDED)
    live_before = snapshot(live)

    long_answer = chat(prefix, "tell a long story", stream=True, max_tokens=200)
    with client.stream("POST", "/v1/chat/completions", json=long_answer) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        owner.kill()
        wait_until(lambda: metric(vllm_stack, READY) == len(live), 10)
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass

    def ask(i: int) -> int:
        return client.post("/v1/chat/completions", json=chat(prefix, f"after {i}")).status_code

    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(ask, range(NUM_AFTER)))
    assert statuses == [200] * NUM_AFTER
    wait_until(lambda: metric(vllm_stack, *RECORDED) == recorded + NUM_AFTER, 10)
    assert sum(delta(live_before, snapshot(live), "vllm:request_success_total")) == NUM_AFTER
    wait_until(lambda: metric(vllm_stack, *FAILED) == failed + 1, 10)  # the cut stream
