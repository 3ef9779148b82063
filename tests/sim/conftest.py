"""Pods served from a background thread for the HTTP tests (fast: no subprocess)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from extproc.sim.launch import SimPods
from extproc.sim.pods import GroupSettings
from testkit.factories import FAST_ENGINE
from testkit.harness import run_sim_pods


@pytest.fixture(scope="module")
def pods() -> Iterator[SimPods]:
    """Two pods shared by a module's tests; tests must not leave faults behind."""
    with run_sim_pods(GroupSettings(num_pods=2, model="sim-llm", engine=FAST_ENGINE)) as group:
        yield group
