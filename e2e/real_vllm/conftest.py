"""Fixtures: 3 real vLLM pods started once per package (in parallel), Envoy + extproc.

The machine must be prepared first (``python -m e2e.real_vllm.prepare``; ``.ci/run``
does it); the ``prepared`` fixture only repeats that check, which takes well under a
second once everything is cached, and installs what is missing otherwise.
Tests marked ``kills_pod`` run last, since the pod they kill stays dead.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e.real_vllm.pods import VllmPod, start_vllm_pods
from e2e.real_vllm.prepare import prepare
from extproc.launch import Stack, run_stack

NUM_PODS = 3


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("kills_pod") is not None)


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
    with run_stack([p.as_pod() for p in vllm_pods]) as running:
        yield running


@pytest.fixture
def client(vllm_stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_stack.url, timeout=60) as c:
        yield c
