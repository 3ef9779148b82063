"""Several extproc replicas behind real Envoys, sharing through a real redis-server: no
lost record whichever replica hears the end, one view, and neither a replica nor Redis
going away fails a request."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import httpx
import pytest

from e2e.support import MODEL, PREFIX_CONFIG, background_load
from extproc.sim.launch import SimPods
from testkit.replicas import Replicas, run_replicas
from testkit.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

OUTCOMES = ("recorded", "recorded_from_metadata", "unknown_request", "failed")


def outcome(stack: Replicas, name: str) -> int:
    return int(stack.total("extproc_completions_total", f'outcome="{name}"'))


def views(stack: Replicas) -> list[int]:
    """Each live replica's prefix-cache entries (equal: one view)."""
    return [
        int(r.metric("kthena_router_prefix_cache_entries"))
        for r in stack.replicas
        if r.proc is not None and r.proc.alive()
    ]


def converged(stack: Replicas) -> bool:
    counts = views(stack)
    return len(set(counts)) == 1 and counts[0] > 0


def tenant_body(i: int) -> dict[str, object]:
    system = f"You are the assistant of tenant {i % 4}. " + "Be brief and exact. " * 60
    return {"model": MODEL, "prompt": f"{system}\nQuestion {i}?", "max_tokens": 1}


@pytest.fixture
def replicas(sim: SimPods, request: pytest.FixtureRequest) -> Iterator[Replicas]:
    envoys, failure_mode_allow = getattr(request, "param", (1, False))
    with run_replicas(
        sim.as_pods(),
        num_envoys=envoys,
        config=PREFIX_CONFIG,
        failure_mode_allow=failure_mode_allow,
    ) as stack:
        yield stack


@pytest.mark.parametrize(
    "replicas",
    [pytest.param((1, False), id="one-envoy"), pytest.param((2, False), id="two")],
    indirect=True,
)
def test_every_end_is_recorded_once_and_the_views_converge(replicas: Replicas) -> None:
    num = 40
    with httpx.Client(timeout=30) as client:
        for i in range(num):
            url = replicas.urls[i % len(replicas.urls)]
            assert client.post(f"{url}/v1/completions", json=tenant_body(i)).status_code == 200
    wait_until(
        lambda: outcome(replicas, "recorded") + outcome(replicas, "recorded_from_metadata") == num,
        timeout_s=10,
        what=lambda: {o: outcome(replicas, o) for o in OUTCOMES},
    )
    assert outcome(replicas, "unknown_request") == 0
    assert outcome(replicas, "recorded_from_metadata") > 0  # the log went to one replica
    wait_until(lambda: converged(replicas), timeout_s=10, what=lambda: views(replicas))
    # Every replica stops counting in flight what it routed, wherever the end was heard.
    wait_until(lambda: replicas.total("extproc_pending_completions") == 0, timeout_s=10)


@pytest.mark.parametrize(
    "replicas",
    [pytest.param((1, True), id="fail-open"), pytest.param((1, False), id="fail-closed")],
    indirect=True,
)
def test_a_replica_killed_under_load_and_restarted_catches_up(replicas: Replicas) -> None:
    first, second = replicas.replicas
    with background_load(replicas.urls[0], tenant_body, workers=4, max_s=90) as load:
        load.wait_for_answers(20)
        first.stop(signal.SIGKILL)
        killed = len(load.outcomes)
        load.wait_for_answers(killed + 40)
        first.start()  # same ports; catches up from the stream, then follows it
        restarted = len(load.outcomes)
        load.wait_for_answers(restarted + 40)
    statuses = load.statuses()
    if replicas.failure_mode_allow:  # a stream to the dead replica goes on unrouted
        assert statuses == {200: len(load.outcomes)}, statuses
    else:  # the few streams sent before the health check marks it down fail (500)
        assert statuses[200] >= 0.95 * len(load.outcomes), statuses
    assert first.metric("extproc_sharing_applied_total", 'kind="end"') > 0  # caught up
    wait_until(lambda: converged(replicas), timeout_s=20, what=lambda: views(replicas))
    assert second.metric("extproc_completions_total", 'outcome="unknown_request"') == 0


def test_redis_killed_and_restarted_mid_run(replicas: Replicas) -> None:
    assert replicas.redis is not None
    with background_load(replicas.urls[0], tenant_body, workers=4, max_s=90) as load:
        load.wait_for_answers(20)
        replicas.redis.stop(signal.SIGKILL)
        wait_until(lambda: replicas.total("extproc_sharing_up") == 0, timeout_s=20)
        down = len(load.outcomes)
        load.wait_for_answers(down + 40)  # routed on with the local views
        replicas.redis.start()  # same port, empty
        wait_until(lambda: replicas.total("extproc_sharing_up") == 2, timeout_s=30)
        load.wait_for_answers(len(load.outcomes) + 20)
    assert load.statuses() == {200: len(load.outcomes)}, load.statuses()
    assert outcome(replicas, "unknown_request") == 0
    wait_until(lambda: converged(replicas), timeout_s=20, what=lambda: views(replicas))
