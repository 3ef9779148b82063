"""The admin port through real Envoy, extproc and simulated pods: ``/debug/pick`` agrees
with the pick the next real request gets, ``/debug/pods`` shows every pod with its
in-flight requests and its view growing, and the port bound to localhost refuses
connections to the machine's other addresses (and takes them when told to bind all)."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.contenders import precise_config
from e2e.support import (
    MODEL,
    PREFIX_CONFIG,
    body_for,
    send_and_wait_recorded,
    served_by,
    unique_prefix,
)
from extproc.sim.launch import SimPods, Stack, free_port, run_stack, spawn_sim_pods
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer
from testkit.kv_events import wait_events_trusted
from testkit.waiting import wait_until

API = "/v1/chat/completions"


@pytest.fixture
def client(admin: tuple[Stack, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=admin[0].url, timeout=30) as c:
        yield c


def pods_state(url: str) -> dict[str, Any]:
    reply = httpx.get(f"{url}/debug/pods", timeout=10)
    assert reply.status_code == 200
    state: dict[str, Any] = reply.json()
    return state


def by_name(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in state["pods"]}


def test_pick_agrees_with_the_next_request(admin: tuple[Stack, str], client: httpx.Client) -> None:
    stack, url = admin
    prefix = unique_prefix()
    warm = send_and_wait_recorded(stack, client, API, body_for(API, prefix, "first question"))
    body = body_for(API, prefix, "second question")
    reply = httpx.post(f"{url}/debug/pick", json={"path": API, "body": body}, timeout=10)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    pick = answer["pick"].split("/", 1)[1]
    assert all(answer["pick"] not in group for group in answer["ties"])  # no draw decides
    assert pick == warm
    assert answer["pods"][0]["predicted_cached_tokens"] > 0
    assert served_by(client.post(API, json=body)) == pick


def test_pods_show_in_flight_and_the_view_growing(
    admin: tuple[Stack, str], client: httpx.Client, sim: SimPods
) -> None:
    stack, url = admin
    before = pods_state(url)
    assert sorted(by_name(before)) == sorted(p.name for p in sim.pods)
    assert all(p["ready"] for p in before["pods"])
    assert all(p["load"]["scrape_age_s"] is not None for p in before["pods"])
    prefix = unique_prefix()
    pod = send_and_wait_recorded(stack, client, API, body_for(API, prefix, "one"))
    after = by_name(pods_state(url))
    grown = after[pod]["views"]["prefix-cache"]["blocks"]
    assert grown > by_name(before)[pod]["views"]["prefix-cache"]["blocks"]
    assert after[pod]["views"]["prefix-cache"]["last_record_age_s"] is not None

    sim.set_faults(pod, delay_s=3.0)  # the next request to it stays in flight a while
    slow = threading.Thread(
        target=client.post, args=(API,), kwargs={"json": body_for(API, prefix, "two")}
    )
    slow.start()
    try:
        wait_until(
            lambda: by_name(pods_state(url))[pod]["in_flight"]["requests"] >= 1,
            what="the delayed request never showed in flight",
        )
        assert by_name(pods_state(url))[pod]["in_flight"]["tokens"] > 0
    finally:
        slow.join(30)
    wait_until(
        lambda: by_name(pods_state(url))[pod]["in_flight"]["requests"] == 0,
        what="the request stayed in flight after it ended",
    )


def other_addresses() -> list[str]:
    """Addresses of this machine other than 127.0.0.1: another loopback address (Linux
    routes all of 127.0.0.0/8 to lo, so it is always there) and its non-loopback IPv4
    addresses, if it has any."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False).stdout
    return ["127.0.0.2", *(a for a in out.split() if "." in a and not a.startswith("127."))]


def listening_address(port: int) -> str:
    """The local IPv4 address a listening socket on ``port`` is bound to (/proc/net/tcp)."""
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                return socket.inet_ntoa(bytes.fromhex(address)[::-1])
    raise AssertionError(f"nothing listens on port {port}")


def test_admin_port_refuses_other_addresses_when_local(admin: tuple[Stack, str]) -> None:
    port = int(admin[1].rsplit(":", 1)[1])
    assert listening_address(port) == "127.0.0.1"
    for address in other_addresses():
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, port), timeout=5).close()


def test_admin_port_takes_other_addresses_when_told(sim: SimPods) -> None:
    """The control: bound to 0.0.0.0, the same connection is taken (so the refusal
    above is the address's doing)."""
    port = free_port()
    args = ["--admin-port", str(port), "--admin-address", "0.0.0.0"]
    with run_stack(sim.as_pods(), config=PREFIX_CONFIG, extproc_args=args):
        assert listening_address(port) == "0.0.0.0"
        for address in other_addresses():
            reply = httpx.get(f"http://{address}:{port}/debug/pods", timeout=10)
            assert reply.status_code == 200 and len(reply.json()["pods"]) == len(sim.pods)


@pytest.fixture(scope="module")
def precise(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimPods, Stack, str]]:
    """Simulated pods publishing KV events, extproc on precise.yaml with its admin port."""
    args = ["--model", MODEL, "--tokenizer", str(MODEL_DIR),
            "--kv-events-endpoint", "tcp://127.0.0.1:*"]  # fmt: skip
    with spawn_sim_pods(3, args=args) as pods:
        config = precise_config(MODEL, MODEL_DIR, 16, tmp_path_factory.mktemp("p") / "p.yaml")
        port = free_port()
        extra = ["--kv-events-topology", "connect", "--admin-port", str(port)]
        with run_stack(pods.as_pods(), config=config, extproc_args=extra) as stack:
            wait_events_trusted(pods.as_pods(), pods.reset_cache, [stack.metrics_text])
            yield pods, stack, f"http://127.0.0.1:{port}"


@needs_model_tokenizer
def test_precise_mode_pick_is_exact_and_the_pods_show_their_events(
    precise: tuple[SimPods, Stack, str],
) -> None:
    sim, stack, url = precise
    prefix = unique_prefix()
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        warm = served_by(client.post(API, json=body_for(API, prefix, "first question")))

        def view_holds_it() -> bool:
            held = sim.stats(warm)["engine"]["num_cached_blocks"]
            return bool(
                held == by_name(pods_state(url))[warm]["views"]["precise-prefix-cache"]["blocks"]
            )

        wait_until(view_holds_it, what="the precise view never matched the pod's cache")
        state = by_name(pods_state(url))
        for name in (p.name for p in sim.pods):
            events = state[name]["kv_events"]
            assert events["next_seq"] is not None and events["last_event_age_s"] is not None
            assert not state[name]["views"]["precise-prefix-cache"]["stale"]
        body = body_for(API, prefix, "second question")
        answer = httpx.post(f"{url}/debug/pick", json={"path": API, "body": body}).json()
        assert answer["exact"] is True and answer["pick"] == f"default/{warm}"
        assert answer["pods"][0]["predicted_cached_tokens"] >= 16
        assert served_by(client.post(API, json=body)) == warm
