"""A pod whose gauges froze is not held over its limits for good (real Envoy, the shipped
default configuration, simulated pods with small caches, scraped).

vLLM makes its gauges' figures after each engine step, so when every request a pod runs
is aborted (the clients went away) it keeps showing them running and their KV cache in
use until its next step (vllm-project/vllm#22545); the simulated pods do the same. Both
pods here then read over the default's ``maxKvUsage`` (0.9) with nothing in flight: flow
control holds the next request, finds the readings frozen after ``FROZEN_S`` and lets one
in, which wakes its pod, where before it was held until its time to live (15 s) ran out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from e2e.support import MODEL, metric
from extproc.routing.flow.saturation import FROZEN_S
from extproc.sim.launch import SimPods, Stack, run_stack, spawn_sim_pods
from testkit.waiting import wait_until

# 10 usable blocks of 16 tokens; each step 50 times as long as the profile's, so a
# request runs for seconds
ENGINE = ["--model", MODEL, "--block-size", "16", "--num-gpu-blocks", "11", "--time-scale", "50"]
PROMPT_BYTES = 560  # 140 tokens of the pods' tokenizer (4 bytes each): 9 blocks, 0.9 of the cache


@pytest.fixture(scope="module")
def small_pods() -> Iterator[SimPods]:
    with spawn_sim_pods(2, args=ENGINE) as pods:
        yield pods


@pytest.fixture(scope="module")
def default_stack(small_pods: SimPods) -> Iterator[Stack]:
    with run_stack(small_pods.as_pods()) as running:
        yield running


class OpenStream:
    """A streamed completion held open on its own thread until ``close``."""

    def __init__(self, stack: Stack, letter: str) -> None:
        self.first_chunk = threading.Event()
        self._close = threading.Event()
        body = {"model": MODEL, "prompt": letter * PROMPT_BYTES, "max_tokens": 16, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(stack.url, body))
        self._thread.start()

    def _run(self, url: str, body: dict[str, object]) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
            for _ in resp.iter_lines():
                self.first_chunk.set()
                if self._close.is_set():
                    return  # leaving the block drops the connection: the pod aborts
            self.first_chunk.set()

    def close(self) -> None:
        self._close.set()
        self._thread.join(30)


def running(pods: SimPods) -> list[int]:
    """The requests each pod's engine runs now (not its gauge)."""
    return [pods.stats(i)["engine"]["num_running"] for i in range(len(pods.pods))]


def kv_gauge(pods: SimPods, pod: int) -> float:
    page = httpx.get(pods.urls[pod] + "/metrics", timeout=5).text
    line = next(x for x in page.splitlines() if x.startswith("vllm:kv_cache_usage_perc{"))
    return float(line.rsplit(" ", 1)[1])


def test_pods_frozen_by_aborts_take_a_request_again(
    default_stack: Stack, small_pods: SimPods
) -> None:
    streams = [OpenStream(default_stack, letter) for letter in "ab"]
    assert all(s.first_chunk.wait(20) for s in streams)
    wait_until(lambda: running(small_pods) == [1, 1], 10, what="one request on each pod")
    wait_until(lambda: min(kv_gauge(small_pods, i) for i in range(2)) >= 0.9, 10)
    time.sleep(1.0)  # scraped by extproc (every 0.2 s)
    for s in streams:
        s.close()
    wait_until(lambda: running(small_pods) == [0, 0], 20, what="the requests aborted")
    assert min(kv_gauge(small_pods, i) for i in range(2)) >= 0.9  # frozen, as vLLM's
    dispatched = metric(
        default_stack, "extproc_flow_dispatched_total", 'priority="0",reason="capacity"', absent=0
    )
    start = time.monotonic()
    body = {"model": MODEL, "prompt": "after the storm", "max_tokens": 2}
    answer = httpx.post(default_stack.url + "/v1/completions", json=body, timeout=30)
    waited = time.monotonic() - start
    assert answer.status_code == 200, answer.text
    # held while both readings were fresh, then let in: well before its 15 s time to live
    assert waited < FROZEN_S + 5.0
    assert (
        metric(default_stack, "extproc_flow_dispatched_total", 'priority="0",reason="capacity"')
        == dispatched + 1
    )
    assert kv_gauge(small_pods, 0) < 0.9 or kv_gauge(small_pods, 1) < 0.9  # one woke
