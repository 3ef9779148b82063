"""LoRA adapters through real Envoy on simulated pods whose pods file names only the base
model: an adapter loaded at run time on one pod (vLLM's ``/v1/load_lora_adapter``) is
routed to that pod alone once extproc has read the pod's ``/v1/models`` (``/debug/pods``
shows it), and refused again once it is unloaded."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from e2e.support import MODEL, served_by
from extproc.sim.launch import SimPods, Stack, free_port, run_stack, spawn_sim_pods
from testkit.waiting import wait_until

ADAPTER = "lora-x"
READ_INTERVAL = ["--models-interval-s", "0.2"]


@pytest.fixture(scope="module")
def lora_sim() -> Iterator[SimPods]:
    with spawn_sim_pods(3, args=["--model", MODEL, "--enable-lora", "--max-loras", "1"]) as sim:
        yield sim


@pytest.fixture(scope="module")
def lora_stack(lora_sim: SimPods) -> Iterator[tuple[Stack, str]]:
    """The stack on the pods as a pods file lists them (no adapter), and its admin URL."""
    admin_port = free_port()
    args = [*READ_INTERVAL, "--admin-port", str(admin_port)]
    with run_stack(lora_sim.as_pods(), extproc_args=args) as stack:
        yield stack, f"http://127.0.0.1:{admin_port}"


def ask(stack: Stack, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "Tell me about adapters.", "max_tokens": 2}
    return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)


def adapters_seen(admin_url: str) -> dict[str, list[str]]:
    pods = httpx.get(f"{admin_url}/debug/pods", timeout=10).json()["pods"]
    return {p["name"]: p["adapters"] for p in pods}


def test_an_adapter_loaded_at_run_time_is_routed_to_its_pod_until_unloaded(
    lora_sim: SimPods, lora_stack: tuple[Stack, str]
) -> None:
    stack, admin_url = lora_stack
    refused = ask(stack, ADAPTER)
    assert refused.status_code == 404 and ADAPTER in refused.text
    holder = lora_sim.pods[1].name
    lora_sim.load_lora_adapter(holder, ADAPTER, "/adapters/x")
    wait_until(lambda: adapters_seen(admin_url)[holder] == [ADAPTER], 10, what="the adapter read")
    assert {name for name, found in adapters_seen(admin_url).items() if found} == {holder}
    served = [ask(stack, ADAPTER) for _ in range(8)]
    assert [r.status_code for r in served] == [200] * 8
    assert {served_by(r) for r in served} == {holder}  # only the pod serving it
    assert ask(stack, MODEL).status_code == 200

    lora_sim.unload_lora_adapter(holder, ADAPTER)
    wait_until(lambda: adapters_seen(admin_url)[holder] == [], 10, what="the unload read")
    assert ask(stack, ADAPTER).status_code == 404
