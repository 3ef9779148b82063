"""End-to-end fixtures: simulated vLLM pods, extproc and a real Envoy, all on 127.0.0.1."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.launch import Stack, run_stack
from extproc.sim.harness import SimPods, spawn_sim_pods
from extproc.types import Pod, PodId

MODEL = "sim-llm"
NUM_PODS = 4


def pods_of(sim: SimPods) -> list[Pod]:
    return [
        Pod(PodId("default", p.name), f"127.0.0.1:{p.port}", frozenset({sim.model}))
        for p in sim.pods
    ]


@pytest.fixture(scope="package")
def sim() -> Iterator[SimPods]:
    with spawn_sim_pods(NUM_PODS, args=["--model", MODEL]) as pods:
        yield pods


PREFIX_CONFIG = Path(__file__).with_name("prefix-cache.yaml")


@pytest.fixture(scope="package")
def stack(sim: SimPods) -> Iterator[Stack]:
    with run_stack(pods_of(sim), config=PREFIX_CONFIG) as running:
        yield running


@pytest.fixture(autouse=True)
def clear_faults(sim: SimPods) -> Iterator[None]:
    yield
    for pod in sim.pods:
        sim.clear_faults(pod.name)


@pytest.fixture
def client(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        yield c


def unique_prefix() -> str:
    """A system prompt no other test sends: 1,200 bytes, so 19 blocks of 64."""
    return f"[{uuid.uuid4()}] " + "You are a meticulous assistant for the routing team. " * 22


def metric(stack: Stack, name: str, labels: str = "") -> float:
    """One sample of extproc's /metrics (0 when absent)."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{{re.escape(labels)}\}})? (\S+)$", re.MULTILINE)
    match = pattern.search(stack.metrics_text())
    return float(match.group(2)) if match else 0.0


def wait_for(predicate: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False
