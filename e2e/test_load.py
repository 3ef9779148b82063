"""Through real Envoy with Kthena's default configuration (least-request filter): a pod whose
queue is full is skipped."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from e2e.support import MODEL, metric
from extproc.sim.launch import SimPods, Stack, run_stack, spawn_sim_pods
from testkit.waiting import wait_until

# One request at a time, about 0.6 s each (60 decode steps of 10 ms): a queue builds fast.
SLOW_POD_ARGS = ["--model", MODEL, "--max-num-seqs", "1"]
SCRAPES = "extproc_scrape_duration_seconds_count"
KTHENA = Path("kthena")  # a shipped configuration, by name (``extproc serve --config kthena``)


@pytest.fixture(scope="module")
def slow_pods() -> Iterator[SimPods]:
    with spawn_sim_pods(3, args=SLOW_POD_ARGS) as pods:
        yield pods


@pytest.fixture(scope="module")
def default_stack(slow_pods: SimPods) -> Iterator[Stack]:
    with run_stack(slow_pods.as_pods(), config=KTHENA) as stack:
        yield stack


def waiting(pod_url: str) -> float:
    text = httpx.get(f"{pod_url}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_waiting{"))
    return float(line.rsplit(" ", 1)[1])


def test_a_pod_whose_queue_is_full_is_filtered_out(
    default_stack: Stack, slow_pods: SimPods
) -> None:
    busy = slow_pods.pods[0]
    body = {"model": MODEL, "prompt": "fill the queue", "max_tokens": 60}
    with ThreadPoolExecutor(14) as pool, httpx.Client(timeout=60) as direct:
        backlog = [
            pool.submit(direct.post, f"{busy.url}/v1/completions", json=body) for _ in range(14)
        ]
        wait_until(lambda: waiting(busy.url) >= 10, timeout_s=10)
        assert "extproc_pods_ready 3.0" in default_stack.metrics_text()
        # extproc has seen the full queue: two more sweeps over every pod's /metrics
        scraped = metric(default_stack, SCRAPES)
        sweeps = 2 * len(slow_pods.pods)
        wait_until(lambda: metric(default_stack, SCRAPES) >= scraped + sweeps, 10)
        with httpx.Client(base_url=default_stack.url, timeout=30) as client:
            for i in range(12):
                resp = client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": f"q{i}", "max_tokens": 1}
                )
                assert resp.status_code == 200
                assert resp.headers["x-sim-pod"] != busy.name
        assert waiting(busy.url) >= 5  # the queue was still long when we finished
        for f in backlog:
            assert f.result().status_code == 200
