"""Two extproc replicas on precise.yaml behind one Envoy (both in its ext_proc cluster),
each connected to every simulated pod's KV events: whichever replica routes a request,
both end up with the same view of every pod, the pods' own cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.contenders import precise_config
from extproc.sim.launch import SimPods, spawn_sim_pods
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer
from testkit.kv_events import wait_events_trusted
from testkit.replicas import Replicas, run_replicas
from testkit.waiting import wait_until

pytestmark = [
    pytest.mark.timeout(300),
    needs_model_tokenizer,
]
MODEL = "sim-llm"


@pytest.fixture(scope="module")
def sim() -> Iterator[SimPods]:
    args = ["--model", MODEL, "--tokenizer", str(MODEL_DIR),
            "--kv-events-endpoint", "tcp://127.0.0.1:*"]  # fmt: skip
    with spawn_sim_pods(3, args=args) as pods:
        yield pods


@pytest.fixture
def replicas(sim: SimPods, tmp_path: Path) -> Iterator[Replicas]:
    config = precise_config(MODEL, MODEL_DIR, 16, tmp_path / "precise.yaml")
    with run_replicas(
        sim.as_pods(),
        redis=False,
        config=config,
        extproc_args=["--kv-events-topology", "connect"],
    ) as stack:
        wait_events_trusted(
            sim.as_pods(), sim.reset_cache, [r.metrics_text for r in stack.replicas]
        )
        yield stack


def view(stack: Replicas, replica: int, pod: str) -> int:
    return int(stack.replicas[replica].metric("extproc_kv_events_blocks", f'pod="default/{pod}"'))


def test_both_replicas_see_the_pods_caches(sim: SimPods, replicas: Replicas) -> None:
    system = "You are the assistant of tenant {t}. Answer in one line. " * 30
    with httpx.Client(timeout=30) as client:
        for i in range(24):
            messages = [{"role": "system", "content": system.format(t=i % 4)},
                        {"role": "user", "content": f"Question {i}?"}]  # fmt: skip
            body = {"model": MODEL, "messages": messages, "max_tokens": 2}
            resp = client.post(f"{replicas.urls[0]}/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
    routed = [r.metric("extproc_route_decisions_total") for r in replicas.replicas]
    assert all(routed), routed  # Envoy sent streams to both replicas

    def exact() -> bool:
        for pod in sim.pods:
            held = sim.stats(pod.name)["engine"]["num_cached_blocks"]
            if not held == view(replicas, 0, pod.name) == view(replicas, 1, pod.name):
                return False
        return True

    wait_until(exact, 10, what=lambda: {
        pod.name: (sim.stats(pod.name)["engine"]["num_cached_blocks"],
                   view(replicas, 0, pod.name), view(replicas, 1, pod.name))
        for pod in sim.pods
    })  # fmt: skip
