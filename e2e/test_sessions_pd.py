"""Through real Envoy with the default configuration: session sticky and prefill/decode."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import pytest

from e2e.support import MODEL, RECORDED, metric
from extproc.pods import PodRole
from extproc.sim.launch import SimPods, Stack, run_stack
from testkit.waiting import wait_until


@pytest.fixture(scope="module")
def pd_stack(sim: SimPods) -> Iterator[Stack]:
    """sim-0, sim-1 decode; sim-2, sim-3 prefill; the shipped default configuration."""
    pods = sim.as_pods()
    roles = [PodRole.DECODE, PodRole.DECODE, PodRole.PREFILL, PodRole.PREFILL]
    with run_stack([dataclasses.replace(p, role=r) for p, r in zip(pods, roles)]) as stack:
        yield stack


def post(stack: Stack, prompt: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    resp = httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


def test_decode_pods_serve_and_the_prefill_header_reaches_them(
    pd_stack: Stack, sim: SimPods
) -> None:
    prefill_addresses = {f"127.0.0.1:{p.port}" for p in sim.pods[2:]}
    for i in range(6):
        resp = post(pd_stack, f"pd request {i} " * 20, {"x-prefiller-host-port": "10.6.6.6:1"})
        pod = resp.headers["x-sim-pod"]
        assert pod in {"sim-0", "sim-1"}
        headers = sim.stats(pod)["recent"][-1]["routing_headers"]
        assert headers["x-prefiller-host-port"] in prefill_addresses  # ours, not the client's


def test_a_session_stays_on_its_pod(pd_stack: Stack) -> None:
    session = {"x-session-id": "conversation-42"}
    before = metric(pd_stack, *RECORDED)
    first = post(pd_stack, "turn one of a long conversation " * 10, session).headers["x-sim-pod"]
    wait_until(lambda: metric(pd_stack, *RECORDED) > before)
    pinned = metric(pd_stack, "extproc_session_pinned_total")
    for turn in range(2, 8):
        resp = post(pd_stack, f"turn {turn}: a different prompt every time " * 10, session)
        assert resp.headers["x-sim-pod"] == first
    assert metric(pd_stack, "extproc_session_pinned_total") == pinned + 6
