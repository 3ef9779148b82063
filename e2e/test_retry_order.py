"""Through real Envoy: a failed try goes to the next pod of extproc's list, in its order,
and never past it.

extproc lists the pick and two fallbacks out of four pods. The test's Envoy is the
generated one plus two response headers, so each answer says which list extproc gave
(the ``envoy.lb`` metadata) and how many tries Envoy made; the pods' own request counters
say which pods were tried. With every pod but one answering 503, a request must be served
by that pod after exactly the listed pods before it failed once each, or, when extproc did
not list it, end with the third listed pod's 503 and no try anywhere else. With a list
shorter than the route's retry count (pods extproc leaves out), the retries stop at its end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import pytest

from e2e.support import (
    API,
    LIST_HEADER,
    PREFIX_CONFIG,
    RECORDED,
    TRIES_HEADER,
    answer_says_list_and_tries,
    body_for,
    metric,
    names_by_address,
    unique_prefix,
)
from extproc.pods import Pod
from extproc.sim.launch import SimPods, Stack, run_stack, write_pods_file
from testkit.waiting import wait_until

BLOCK = 64  # bytes a prefix-cache block (e2e/prefix-cache.yaml's blockSizeToHash)
BLOCKS = 16  # whole blocks of unique_prefix() (1,200 bytes and more)
PLANT_TRIES = 30  # unlisted each time: 1 in 2 at worst, 2**-30 for all


@pytest.fixture(scope="module")
def order_stack(sim: SimPods) -> Iterator[Stack]:
    with run_stack(
        sim.as_pods(), config=PREFIX_CONFIG, envoy_transform=answer_says_list_and_tries
    ) as stack:
        yield stack


def tries_per_pod(sim: SimPods) -> dict[str, int]:
    return {p.name: sim.stats(p.name)["num_requests"] for p in sim.pods}


def send(
    stack: Stack, client: httpx.Client, sim: SimPods, prefix: str, question: str = "q"
) -> tuple[httpx.Response, list[str]]:
    """A prompt's answer and extproc's list for it, as pod names."""
    resp = client.post(API, json=body_for(API, prefix, question))
    by_address = names_by_address(sim)
    return resp, [by_address[a] for a in resp.headers[LIST_HEADER].split(",")]


def only_working(sim: SimPods, working: str) -> None:
    """Every pod but ``working`` answers 503."""
    for pod in sim.pods:
        sim.set_faults(pod.name, error_rate=0.0 if pod.name == working else 1.0, error_status=503)


def plant(stack: Stack, client: httpx.Client, sim: SimPods, prompt: str, pod: str) -> None:
    """Make extproc's view hold ``prompt`` on ``pod``: sent with only ``pod`` answering
    until extproc lists it and Envoy's retries reach it (listed at least one time in
    two), then recorded where served."""
    only_working(sim, pod)
    for _ in range(PLANT_TRIES):
        recorded = metric(stack, *RECORDED)
        resp, _ = send(stack, client, sim, prompt, "")
        if resp.status_code == 200:
            assert resp.headers["x-sim-pod"] == pod
            wait_until(lambda: metric(stack, *RECORDED) > recorded, timeout_s=10)  # noqa: B023
            return
    pytest.fail(f"{pod} was never listed for the prompt in {PLANT_TRIES} tries")


def ranked(stack: Stack, client: httpx.Client, sim: SimPods, pods: list[str]) -> str:
    """A fresh prefix whose blocks extproc's view holds on ``pods[0]`` (all), ``pods[1]``
    (about half), ``pods[2]`` (a quarter) and ``pods[3]`` (none): a question after it
    is listed ``pods[:3]`` in that order, by prefix score alone, with no tie to draw."""
    prefix = unique_prefix()
    for pod, share in zip(pods[2::-1], (BLOCKS // 4, BLOCKS // 2, None), strict=True):
        plant(stack, client, sim, prefix if share is None else prefix[: share * BLOCK], pod)
    return prefix


@pytest.mark.parametrize("position", [0, 1, 2, None], ids=["first", "second", "third", "unlisted"])
def test_retries_walk_extprocs_list_in_order_and_stop_at_its_end(
    order_stack: Stack, sim: SimPods, position: int | None
) -> None:
    """The working pod listed at ``position`` of three (None: left out), the pods ranked
    by their prefix scores beforehand, each position rotating the pods' roles."""
    names = [p.name for p in sim.pods]
    turn = 3 if position is None else position
    pods = names[turn:] + names[:turn]
    working = pods[turn]  # the fourth, unranked pod when left out
    with httpx.Client(base_url=order_stack.url, timeout=30) as client:
        prefix = ranked(order_stack, client, sim, pods)
        only_working(sim, working)
        before = tries_per_pod(sim)
        resp, listed = send(order_stack, client, sim, prefix)
    tried = {n: c - before[n] for n, c in tries_per_pod(sim).items()}
    assert listed == pods[:3], (listed, pods)
    if position is None:  # the whole list failed: its last pod's 503, nothing else
        assert working not in listed
        assert resp.status_code == 503, resp.text
        assert resp.headers["x-sim-pod"] == listed[-1]
        assert resp.headers[TRIES_HEADER] == "3"
        assert tried == {n: int(n in listed) for n in names}, (listed, tried)
    else:  # served by the working pod after the listed pods before it, once each
        assert listed[position] == working
        assert resp.status_code == 200 and resp.headers["x-sim-pod"] == working
        assert resp.headers[TRIES_HEADER] == str(position + 1)
        expected = {n: int(n in listed[: position + 1]) for n in names}
        assert tried == expected, (listed, tried)


def test_a_list_shorter_than_the_retries_is_not_walked_past(
    order_stack: Stack, sim: SimPods
) -> None:
    """Two of four pods not ready: extproc lists two, Envoy's route would retry twice; the
    second retry must not reach an unlisted pod (which would answer 200 here)."""
    pods = sim.as_pods()
    short: list[Pod] = [*pods[:2], *(dataclasses.replace(p, ready=False) for p in pods[2:])]
    write_pods_file(short, order_stack.pods_file)
    try:
        wait_until(lambda: metric(order_stack, "extproc_pods_ready") == 2, timeout_s=10)
        listed_pods = {p.id.name for p in pods[:2]}
        for name in listed_pods:
            sim.set_faults(name, error_rate=1.0, error_status=503)
        with httpx.Client(base_url=order_stack.url, timeout=30) as client:
            for _ in range(4):
                before = tries_per_pod(sim)
                resp, listed = send(order_stack, client, sim, unique_prefix())
                tried = {n: c - before[n] for n, c in tries_per_pod(sim).items()}
                assert set(listed) == listed_pods
                assert resp.status_code == 503 and resp.headers["x-sim-pod"] == listed[-1]
                assert resp.headers[TRIES_HEADER] == "2"
                assert tried == {p.name: int(p.name in listed_pods) for p in sim.pods}, tried
    finally:
        write_pods_file(pods, order_stack.pods_file)
        wait_until(lambda: metric(order_stack, "extproc_pods_ready") == 4, timeout_s=10)
