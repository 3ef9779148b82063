"""Several extproc replicas behind real Envoys, sharing through a real redis-server: no
lost record whichever replica hears the end, one view (the same blocks on the same pods,
read from each replica's /debug/pick), and neither a replica nor Redis going away fails a
request. Without Redis, the record metadata alone: every end recorded once, on the pod
that served it, by whichever replica heard it."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from e2e.support import MODEL, PREFIX_CONFIG, background_load
from extproc.sim.launch import SimPods
from testkit.replicas import Replica, Replicas, run_replicas
from testkit.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

LOAD_WORKERS = 4
OUTCOMES = ("recorded", "recorded_from_metadata", "unknown_request", "failed")


def outcome(stack: Replicas, name: str) -> int:
    return int(stack.total("extproc_completions_total", f'outcome="{name}"'))


PROBES = 20  # the first requests of every test, each tenant's prompt with its own question
COMPLETIONS = "/v1/completions"


def held(replica: Replica, body: dict[str, object]) -> dict[str, int]:
    """Per pod, the share of the request's blocks the replica's view holds there (the
    prefix-cache score: matched blocks out of the prompt's, in percent)."""
    answer = replica.explain(COMPLETIONS, body)
    scores = answer["passes"][0]["scores"]
    return next(dict(s["scores"]) for s in scores if s["name"] == "prefix-cache")


def views(stack: Replicas) -> list[list[dict[str, int]]]:
    """Each live replica's view of the probe requests (equal: one view)."""
    probes = [tenant_body(i) for i in range(PROBES)]
    return [
        [held(r, body) for body in probes]
        for r in stack.replicas
        if r.proc is not None and r.proc.alive()
    ]


def converged(stack: Replicas) -> bool:
    """Every live replica holds the same blocks on the same pods, every probe somewhere."""
    seen = views(stack)
    return all(v == seen[0] for v in seen) and all(max(p.values()) > 0 for p in seen[0])


def tenant_body(i: int) -> dict[str, object]:
    system = f"You are the assistant of tenant {i % 4}. " + "Be brief and exact. " * 60
    return {"model": MODEL, "prompt": f"{system}\nQuestion {i}?", "max_tokens": 1}


def send(stack: Replicas, num: int) -> list[str]:
    """``num`` tenants' requests, spread over the Envoys; the pod that served each."""
    served = []
    with httpx.Client(timeout=30) as client:
        for i in range(num):
            url = stack.urls[i % len(stack.urls)]
            resp = client.post(f"{url}{COMPLETIONS}", json=tenant_body(i))
            assert resp.status_code == 200, resp.text
            served.append(resp.headers["x-sim-pod"])
    return served


def wait_recorded_once(stack: Replicas, num: int) -> None:
    """Every one of the ``num`` ends recorded, by one replica (the totals of both)."""
    wait_until(
        lambda: outcome(stack, "recorded") + outcome(stack, "recorded_from_metadata") == num,
        timeout_s=10,
        what=lambda: {o: outcome(stack, o) for o in OUTCOMES},
    )
    assert outcome(stack, "unknown_request") == 0


def assert_held_where_served(replica: Replica, served: list[str]) -> None:
    """Each request's whole prompt held on the pod that served it (its own question is
    its last block: no other request put it there)."""
    for i, pod in enumerate(served):
        view = held(replica, tenant_body(i))
        assert view[f"default/{pod}"] == 100, (i, pod, view)


@pytest.fixture
def replicas(sim: SimPods, request: pytest.FixtureRequest) -> Iterator[Replicas]:
    envoys, failure_mode_allow = getattr(request, "param", (1, False))
    with run_replicas(
        sim.as_pods(),
        num_envoys=envoys,
        config=PREFIX_CONFIG,
        failure_mode_allow=failure_mode_allow,
        admin=True,
    ) as stack:
        yield stack


@pytest.mark.parametrize(
    "replicas",
    [pytest.param((1, False), id="one-envoy"), pytest.param((2, False), id="two")],
    indirect=True,
)
def test_every_end_is_recorded_once_and_the_views_converge(replicas: Replicas) -> None:
    served = send(replicas, 40)
    wait_recorded_once(replicas, len(served))
    assert outcome(replicas, "recorded_from_metadata") > 0  # the log went to one replica
    wait_until(lambda: converged(replicas), timeout_s=10, what=lambda: views(replicas))
    for replica in replicas.replicas:  # one view, and the view of what the pods did
        assert_held_where_served(replica, served)
    # Every replica stops counting in flight what it routed, wherever the end was heard.
    wait_until(lambda: replicas.total("extproc_pending_completions") == 0, timeout_s=10)


@pytest.mark.parametrize(
    "replicas",
    [pytest.param((1, True), id="fail-open"), pytest.param((1, False), id="fail-closed")],
    indirect=True,
)
def test_a_replica_killed_under_load_and_restarted_catches_up(replicas: Replicas) -> None:
    first, second = replicas.replicas
    with background_load(replicas.urls[0], tenant_body, workers=LOAD_WORKERS, max_s=90) as load:
        load.wait_for_answers(20)
        killed_at = time.monotonic()
        first.stop(signal.SIGKILL)
        load.wait_for_answers(40, since=killed_at)
        first.start()  # same ports; catches up from the stream, then follows it
        restarted_at = time.monotonic()
        load.wait_for_answers(40, since=restarted_at)
    failed = [(t, status) for t, status, _ in load.outcomes if status != 200]
    if replicas.failure_mode_allow:  # a stream to the dead replica goes on unrouted
        assert failed == [], load.statuses()
    else:
        # Only streams on the dead replica fail (500): those open at the kill and one new
        # one a worker before Envoy ejects it (at its first refused stream) or its health
        # check marks it down; a count, whatever the request rate or the machine's load.
        assert all(killed_at <= t < restarted_at and s == 500 for t, s in failed), failed
        assert len(failed) <= 2 * LOAD_WORKERS, failed
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


@pytest.fixture
def without_redis(sim: SimPods) -> Iterator[Replicas]:
    with run_replicas(sim.as_pods(), redis=False, config=PREFIX_CONFIG, admin=True) as stack:
        yield stack


def test_without_redis_each_end_is_recorded_once_on_its_pod_from_the_metadata(
    without_redis: Replicas,
) -> None:
    """No Redis: a replica's view is what it heard, and the access log reaches the replica
    of Envoy's choosing; the requests the other replica routed are recorded there from the
    record metadata Envoy hands back, on the pod that served them."""
    served = send(without_redis, 40)
    routed = [r.metric("extproc_route_decisions_total") for r in without_redis.replicas]
    assert all(routed), routed  # Envoy sent streams to both replicas
    wait_recorded_once(without_redis, len(served))
    assert outcome(without_redis, "recorded_from_metadata") > 0
    for i, pod in enumerate(served):  # held whole by one replica alone, on its pod
        holders = [
            (r.index, pod_id)
            for r in without_redis.replicas
            for pod_id, score in held(r, tenant_body(i)).items()
            if score == 100
        ]
        assert [p for _, p in holders] == [f"default/{pod}"], (i, pod, holders)
