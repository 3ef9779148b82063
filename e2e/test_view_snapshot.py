"""``--view-snapshot`` through Envoy: extproc restarted with SIGTERM keeps its prefix view,
so each tenant's prefix goes back to its pod; without the file it starts empty; a damaged
file is refused and extproc serves all the same."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from e2e.support import (
    ENTRIES,
    PREFIX_CONFIG,
    body_for,
    metric,
    send_and_wait_recorded,
    served_by,
    unique_prefix,
)
from extproc.sim.launch import SimPods, Stack, run_stack
from testkit.waiting import wait_until

API = "/v1/completions"
TENANTS = 8  # on 4 pods: the chance that all return to their pods by luck is 4^-8
MISSES = ("kthena_router_prefix_cache_match_ratio_bucket", 'le="0.0",model="sim-llm"')
LOADS = "extproc_view_snapshot_loads_total"


@pytest.fixture(scope="module")
def snapshot_stack(sim: SimPods, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    path = tmp_path_factory.mktemp("view") / "view.npz"
    args = ["--view-snapshot", str(path), "--drain-s", "2"]
    with run_stack(sim.as_pods(), config=PREFIX_CONFIG, extproc_args=args) as stack:
        stack.snapshot_path = path  # type: ignore[attr-defined]
        yield stack


def snapshot_path(stack: Stack) -> Path:
    path: Path = stack.snapshot_path  # type: ignore[attr-defined]
    return path


@pytest.fixture
def client(snapshot_stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=snapshot_stack.url, timeout=30) as c:
        yield c


def restart(
    stack: Stack, client: httpx.Client, change_file: Callable[[Path], None] | None = None
) -> None:
    """SIGTERM (the drain writes the file), ``change_file`` on it, start again, and wait
    until Envoy routes through the new process."""
    stack.extproc.stop()
    if change_file is not None:
        change_file(snapshot_path(stack))
    stack.extproc = stack.start_extproc_again()
    wait_until(
        lambda: client.post(API, json=body_for(API, "probe ", "up?")).status_code == 200,
        30,
        what="requests through the restarted extproc",
    )


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def first_pods(stack: Stack, client: httpx.Client) -> dict[str, str]:
    """Each new tenant's prefix, recorded on the pod that served it."""
    pods = {}
    for i in range(TENANTS):
        prefix = unique_prefix()
        pods[prefix] = send_and_wait_recorded(stack, client, API, body_for(API, prefix, f"q{i}"))
    return pods


def test_a_restarted_extproc_sends_each_prefix_to_its_pod(
    snapshot_stack: Stack, client: httpx.Client
) -> None:
    stack = snapshot_stack
    pods = first_pods(stack, client)
    entries = metric(stack, *ENTRIES)
    restart(stack, client)
    assert metric(stack, LOADS, 'result="loaded"') == 1
    # the probe recorded after the load: what was loaded is what was there
    assert metric(stack, "extproc_view_snapshot_loaded_entries", 'plugin="prefix-cache"') == (
        entries
    )
    misses = metric(stack, *MISSES)
    for prefix, pod in pods.items():
        assert served_by(client.post(API, json=body_for(API, prefix, "again?"))) == pod
    assert metric(stack, *MISSES) == misses  # every one matched the restored view


def test_without_the_file_the_view_starts_empty(
    snapshot_stack: Stack, client: httpx.Client
) -> None:
    """The control: the same steps with the file removed before the start match nothing."""
    stack = snapshot_stack
    pods = first_pods(stack, client)
    restart(stack, client, change_file=Path.unlink)
    assert metric(stack, LOADS, 'result="missing"') == 1
    misses = metric(stack, *MISSES)
    for prefix in pods:
        served_by(client.post(API, json=body_for(API, prefix, "again?")))
    assert metric(stack, *MISSES) == misses + TENANTS


def test_a_damaged_file_is_refused_and_extproc_serves_empty(
    snapshot_stack: Stack, client: httpx.Client
) -> None:
    stack = snapshot_stack
    pods = first_pods(stack, client)
    restart(stack, client, change_file=truncate)
    assert metric(stack, LOADS, 'result="refused"') == 1
    assert "view snapshot" in stack.extproc.log_tail() and "refused" in stack.extproc.log_tail()
    misses = metric(stack, *MISSES)
    for prefix in pods:
        served_by(client.post(API, json=body_for(API, prefix, "again?")))
    assert metric(stack, *MISSES) == misses + TENANTS
