"""End-to-end fixtures: simulated vLLM pods, extproc and a real Envoy, all on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from e2e.support import MODEL, NUM_PODS, PREFIX_CONFIG
from extproc.sim.launch import SimPods, Stack, free_port, run_stack, spawn_sim_pods


@pytest.fixture(scope="package")
def sim() -> Iterator[SimPods]:
    with spawn_sim_pods(NUM_PODS, args=["--model", MODEL]) as pods:
        yield pods


@pytest.fixture(scope="package")
def stack(sim: SimPods) -> Iterator[Stack]:
    with run_stack(sim.as_pods(), config=PREFIX_CONFIG) as running:
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


@pytest.fixture(scope="module")
def admin(sim: SimPods) -> Iterator[tuple[Stack, str]]:
    """A stack whose extproc serves its admin port (default address); it and the port's
    URL (no trailing slash)."""
    port = free_port()
    with run_stack(
        sim.as_pods(), config=PREFIX_CONFIG, extproc_args=["--admin-port", str(port)]
    ) as stack:
        yield stack, f"http://127.0.0.1:{port}"
