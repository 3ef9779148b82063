"""Router bookkeeping: in-flight counts and the bounded table of pending completions."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from extproc.routing.pending import DEFAULT_MAX_PENDING, DEFAULT_PENDING_TTL_S
from extproc.routing.router import Router
from testkit.factories import PREFIX_ONLY, make_pod, make_scheduler

BODY = b'{"model": "m", "prompt": "hello there"}'


def make_router(
    max_pending: int = DEFAULT_MAX_PENDING, pending_ttl_s: float = DEFAULT_PENDING_TTL_S
) -> Router:
    pods = [make_pod(f"p{i}", port=8000 + i) for i in range(3)]
    return Router(
        make_scheduler(PREFIX_ONLY),
        pods,
        max_pending=max_pending,
        pending_ttl_s=pending_ttl_s,
        registry=CollectorRegistry(),
    )


def test_a_routed_request_is_in_flight_on_its_pick_until_it_ends() -> None:
    router = make_router()
    decision = router.route("/v1/completions", BODY, request_id="r1")
    pick = decision.pods[0]
    assert router.in_flight.get(pick.id) == 1
    router.complete("r1", decision.pods[1].address, succeeded=True, attempts=2)
    assert router.in_flight.get(pick.id) == 0  # ended on the pick, although another served


def test_failed_requests_end_too_and_requests_without_id_are_not_tracked() -> None:
    router = make_router()
    decision = router.route("/v1/completions", BODY, request_id="r1")
    router.complete("r1", decision.pods[0].address, succeeded=False)
    assert router.in_flight.get(decision.pods[0].id) == 0
    untracked = router.route("/v1/completions", BODY)
    assert router.in_flight.get(untracked.pods[0].id) == 0 and len(router.pending) == 0


def test_pending_table_is_bounded_and_dropped_entries_end_in_flight() -> None:
    router = make_router(max_pending=2)
    picks = [router.route("/v1/completions", BODY, request_id=f"r{i}").pods[0] for i in range(5)]
    assert len(router.pending) == 2 and router.pending.num_dropped == 3
    assert sum(router.in_flight.get(p.id) for p in {p.id: p for p in picks}.values()) == 2
    assert router.complete("r0", picks[0].address, succeeded=True) is False  # dropped


def test_pending_entries_expire_by_age() -> None:
    router = make_router(pending_ttl_s=0.0)
    router.route("/v1/completions", BODY, request_id="old")
    router.route("/v1/completions", BODY, request_id="new")  # expires "old" on insert
    assert router.pending.pop("old") is None and router.pending.num_dropped >= 1
