"""Through real Envoy on grpcio's public server (``--grpc-server public``), the fallback
when the installed grpcio cannot carry the loop server: routing, retries, recording."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from e2e.support import MODEL, PREFIX_CONFIG, RECORDED, metric, unique_prefix
from extproc.sim.launch import SimPods, Stack, run_stack
from testkit.waiting import wait_until


@pytest.fixture(scope="module")
def public_stack(sim: SimPods) -> Iterator[Stack]:
    with run_stack(
        sim.as_pods(), config=PREFIX_CONFIG, extproc_args=["--grpc-server", "public"]
    ) as running:
        yield running


def test_routes_retries_and_records_on_the_public_server(public_stack: Stack, sim: SimPods) -> None:
    assert "gRPC port served by grpcio's public server" in public_stack.extproc.log_tail(20_000)
    body = {"model": MODEL, "prompt": unique_prefix() + "question?", "max_tokens": 2}
    with httpx.Client(base_url=public_stack.url, timeout=30) as client:
        before = metric(public_stack, *RECORDED)
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        pod = first.headers["x-sim-pod"]
        wait_until(lambda: metric(public_stack, *RECORDED) > before)
        assert [
            client.post("/v1/completions", json=body).headers["x-sim-pod"] for _ in range(3)
        ] == [pod] * 3
        sim.set_faults(
            pod, error_rate=1.0, error_status=503
        )  # the picked pod fails: Envoy retries the next listed
        try:
            retried = client.post("/v1/completions", json=body)
        finally:
            sim.clear_faults(pod)
        assert retried.status_code == 200 and retried.headers["x-sim-pod"] != pod
