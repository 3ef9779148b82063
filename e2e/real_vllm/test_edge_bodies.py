"""The edge-body corpus (``testkit.edge_bodies``) sent straight to a real vLLM pod and
through Envoy + extproc in front of it (issue 33: accept what the engine accepts).

For each body, both answers are measured live and compared:

* vLLM serves it (2xx): through Envoy it is served too, and extproc routed it (its
  ``extproc_route_decisions_total`` moved: Envoy runs with ``failure_mode_allow`` off, so
  nothing reaches the pod unless extproc picked it);
* vLLM refuses it (4xx): through Envoy the answer is a 4xx too (extproc's own, or the
  pod's after extproc routed it);
* never a 5xx on either side;
* vLLM's status is the one ``testkit.edge_bodies.VLLM_STATUS`` records.

Bodies naming no model (absent, null or ``""``), which vLLM serves with its served model,
are routed as that model too (the pool serves one), so no row is an exception. One pod,
started once for the module.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e.real_vllm.pods import MODEL, VllmPod, start_vllm_pods
from e2e.real_vllm.prepare import prepare
from e2e.support import PREFIX_CONFIG, metric
from extproc.sim.launch import Stack, run_stack
from testkit.edge_bodies import VLLM_STATUS, edge_bodies

pytestmark = [pytest.mark.e2e, pytest.mark.real_vllm, pytest.mark.timeout(600)]

CORPUS = {e.name: e for e in edge_bodies(MODEL)}
ROUTED = ("extproc_route_decisions_total", f'model="{MODEL}"')
HEADERS = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def edge_pod() -> Iterator[VllmPod]:
    prepare()
    with (
        tempfile.TemporaryDirectory(prefix="extproc-vllm-edge-") as tmp,
        start_vllm_pods(1, Path(tmp)) as (pod,),
    ):
        yield pod


@pytest.fixture(scope="module")
def edge_stack(edge_pod: VllmPod) -> Iterator[Stack]:
    with run_stack([edge_pod.as_pod()], config=PREFIX_CONFIG) as running:
        yield running


@pytest.fixture(scope="module")
def direct(edge_pod: VllmPod) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=edge_pod.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def through(edge_stack: Stack) -> Iterator[httpx.Client]:
    # Envoy may close a connection after an error: a fresh one per request keeps rows apart.
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=edge_stack.url, timeout=60, limits=limits) as c:
        yield c


def status_class(status: int) -> int:
    return status // 100


@pytest.mark.parametrize("name", list(CORPUS))
def test_extproc_routes_what_vllm_serves(
    name: str, edge_stack: Stack, direct: httpx.Client, through: httpx.Client
) -> None:
    edge = CORPUS[name]
    engine = direct.post(edge.api.value, content=edge.body, headers=HEADERS)
    routed_before = metric(edge_stack, *ROUTED, absent=0.0)
    answer = through.post(edge.api.value, content=edge.body, headers=HEADERS)
    routed = metric(edge_stack, *ROUTED, absent=0.0) - routed_before
    outcome = f"vLLM {engine.status_code} {engine.text[:200]!r}; through Envoy {answer.status_code} {answer.text[:200]!r}"
    assert status_class(engine.status_code) in (2, 4), outcome
    # the recorded column the simulated pods are checked against (tests/sim) is still true
    assert engine.status_code == VLLM_STATUS[name], outcome
    assert status_class(answer.status_code) in (2, 4), outcome
    if status_class(engine.status_code) == 2:
        assert status_class(answer.status_code) == 2 and routed == 1, outcome
    else:
        assert status_class(answer.status_code) == 4, outcome
