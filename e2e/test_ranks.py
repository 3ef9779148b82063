"""Data-parallel ranks through real Envoy: one pod with two ports in the pods file (two
simulated pods on 127.0.0.1 stand for its ranks) is two endpoints, ``dp-rank-0`` and
``dp-rank-1``: requests reach both, each is recorded for its own port (a prefix sent
again goes back to the rank that served it), and each rank's metrics page is scraped."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from e2e.support import (
    MODEL,
    PREFIX_CONFIG,
    body_for,
    metric,
    send_and_wait_recorded,
    unique_prefix,
)
from extproc.sim.launch import SimPods, Stack, free_port, run_stack, spawn_sim_pods
from testkit.waiting import wait_until

API = "/v1/completions"
RANKS = ("dp-rank-0", "dp-rank-1")
MAX_FRESH = 40  # fresh prefixes sent until both ranks served one (ties go either way)


@pytest.fixture(scope="module")
def ranks() -> Iterator[SimPods]:
    with spawn_sim_pods(2, args=["--model", MODEL]) as sim:
        yield sim


@pytest.fixture(scope="module")
def dp(ranks: SimPods, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    """extproc on a pods file with one pod ``dp`` of two ports, Envoy in front; the stack
    and extproc's admin URL."""
    pods_file = tmp_path_factory.mktemp("ranks") / "pods.yaml"
    entry = {"name": "dp", "address": "127.0.0.1", "ports": [p.port for p in ranks.pods]}
    pods_file.write_text(yaml.safe_dump({"pods": [{**entry, "models": [MODEL]}]}))
    admin_port = free_port()
    extproc_args = ["--admin-port", str(admin_port)]
    with run_stack(pods_file, config=PREFIX_CONFIG, extproc_args=extproc_args) as stack:
        yield stack, f"http://127.0.0.1:{admin_port}"


def rank_of(ranks: SimPods) -> dict[str, str]:
    """The simulated pod's name (``x-sim-pod``) -> the rank it stands for."""
    return {p.name: rank for p, rank in zip(ranks.pods, RANKS, strict=True)}


def pods_state(url: str) -> dict[str, dict[str, Any]]:
    reply = httpx.get(f"{url}/debug/pods", timeout=10)
    assert reply.status_code == 200, reply.text
    return {p["name"]: p for p in reply.json()["pods"]}


def test_each_port_is_an_endpoint_of_its_own(dp: tuple[Stack, str], ranks: SimPods) -> None:
    state = pods_state(dp[1])
    assert sorted(state) == list(RANKS)
    assert [state[r]["address"] for r in RANKS] == [f"127.0.0.1:{p.port}" for p in ranks.pods]
    assert all(state[r]["id"] == f"default/{r}" and state[r]["models"] == [MODEL] for r in RANKS)


def test_requests_reach_both_ranks_and_a_prefix_returns_to_its_rank(
    dp: tuple[Stack, str], ranks: SimPods
) -> None:
    stack, url = dp
    rank = rank_of(ranks)
    prefix_of: dict[str, str] = {}
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        for _ in range(MAX_FRESH):
            prefix = unique_prefix()
            served = send_and_wait_recorded(stack, client, API, body_for(API, prefix, "hello?"))
            prefix_of.setdefault(rank[served], prefix)
            if len(prefix_of) == len(RANKS):
                break
        assert sorted(prefix_of) == list(RANKS), f"{MAX_FRESH} fresh prefixes all went to one rank"
        for name, prefix in prefix_of.items():
            for i in range(3):
                body = body_for(API, prefix, f"again {i}?")
                assert rank[send_and_wait_recorded(stack, client, API, body)] == name
    state = pods_state(url)
    for name in RANKS:
        labels = f'model="{MODEL}",pod="default/{name}"'
        assert metric(stack, "extproc_request_first_byte_seconds_count", labels) >= 4
        assert metric(stack, "extproc_predicted_cached_tokens_total", labels) > 0
        assert all(view["blocks"] > 0 for view in state[name]["views"].values()), state[name]


def test_each_ranks_metrics_page_is_scraped_at_its_own_port(
    dp: tuple[Stack, str], ranks: SimPods
) -> None:
    stack, url = dp
    wait_until(
        lambda: all(pods_state(url)[r]["load"]["scrape_age_s"] is not None for r in RANKS),
        what="both ranks scraped",
    )

    def errors(rank: str) -> float:
        labels = f'pod="default/{rank}",reason="http_status"'
        return metric(stack, "extproc_scrape_errors_total", labels, absent=0)

    before = errors(RANKS[0])
    ranks.set_faults(ranks.pods[1].name, metrics="error")  # rank 1's page answers 500
    try:
        wait_until(lambda: errors(RANKS[1]) > 0, what="rank 1's failed scrape counted")
        assert errors(RANKS[0]) == before
    finally:
        ranks.clear_faults(ranks.pods[1].name)
