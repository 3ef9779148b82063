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

# One request at a time: a long one running (decode steps of about 10 ms), the rest wait.
SLOW_POD_ARGS = ["--model", MODEL, "--max-num-seqs", "1"]
HOG_TOKENS = 6000  # about a minute of decoding; cut (the client leaves) once checked
QUEUED = 12  # waiting behind it: over maxWaitingRequests (10)
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
    """The busy pod runs one long streamed request (about a minute) while QUEUED short
    ones wait behind it: its queue stays full for as long as the test needs, however
    slow the machine, and empties once the long one is cut."""
    busy = slow_pods.pods[0]
    short = {"model": MODEL, "prompt": "fill the queue", "max_tokens": 1}
    hog = {**short, "max_tokens": HOG_TOKENS, "stream": True}
    with ThreadPoolExecutor(QUEUED) as pool, httpx.Client(timeout=60) as direct:
        with direct.stream("POST", f"{busy.url}/v1/completions", json=hog) as running:
            lines = running.iter_lines()  # kept: closing it would cut the long request
            assert next(line for line in lines if line.startswith("data: "))
            backlog = [
                pool.submit(direct.post, f"{busy.url}/v1/completions", json=short)
                for _ in range(QUEUED)
            ]
            wait_until(lambda: waiting(busy.url) == QUEUED, timeout_s=10)
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
            assert waiting(busy.url) == QUEUED  # the queue was still full when we finished
        for f in backlog:  # the long request cut, the queue drains
            assert f.result(timeout=60).status_code == 200
