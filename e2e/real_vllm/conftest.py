"""Fixtures: 3 real vLLM pods started once per package (in parallel), Envoy + extproc.

extproc runs the e2e prefix-cache configuration (least-request filter, prefix-cache
score), as the simulated-pod e2e tests do, so affinity is what is tested.

The machine should be prepared first (``make vllm``; ``.ci/run`` does it): the
``vllm_pods`` fixture calls ``prepare()`` again, which takes well under a second once
everything is cached and installs what is missing otherwise. Tests marked ``kills_pod``
run right after this package's other tests, since the pod they kill stays dead.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e.real_vllm.pods import VllmPod, start_vllm_pods
from e2e.real_vllm.prepare import prepare
from e2e.support import PREFIX_CONFIG
from extproc.sim.launch import Stack, run_stack

NUM_PODS = 3


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    killers = [item for item in items if item.get_closest_marker("kills_pod")]
    rest = [item for item in items if not item.get_closest_marker("kills_pod")]
    here = Path(__file__).parent
    ours = [n for n, item in enumerate(rest) if here in item.path.parents]
    cut = ours[-1] + 1 if ours else len(rest)
    items[:] = [*rest[:cut], *killers, *rest[cut:]]


@pytest.fixture(scope="package")
def vllm_pods() -> Iterator[list[VllmPod]]:
    prepare()
    with (
        tempfile.TemporaryDirectory(prefix="extproc-vllm-") as tmp,
        start_vllm_pods(NUM_PODS, Path(tmp)) as pods,
    ):
        yield pods


@pytest.fixture(scope="package")
def vllm_stack(vllm_pods: list[VllmPod]) -> Iterator[Stack]:
    with run_stack([p.as_pod() for p in vllm_pods], config=PREFIX_CONFIG) as running:
        yield running


@pytest.fixture
def client(vllm_stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_stack.url, timeout=60) as c:
        yield c
