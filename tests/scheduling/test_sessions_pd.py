"""Session sticky and prefill/decode disaggregation in the scheduler."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest
from prometheus_client import CollectorRegistry

from extproc.errors import NoReadyPods
from extproc.pods import Pod, PodId, PodRole
from extproc.request.parse import Api, InferenceRequest
from extproc.scheduling.interfaces import Cycle
from extproc.scheduling.scheduler import Scheduler
from extproc.scheduling.sessions import Binding, SessionStore
from testkit.factories import PREFIX_ONLY, make_pod, make_scheduler


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class DropFilter:
    type_name: ClassVar[str] = "drop"

    def __init__(self) -> None:
        self.drop: set[str] = set()

    def filter(self, cycle: Cycle, pods: Sequence[Pod]) -> Sequence[Pod]:
        return [p for p in pods if p.id.name not in self.drop]


def cycle(prompt: str = "hello " * 40, session: str | None = "s1") -> Cycle:
    return Cycle(InferenceRequest(Api.COMPLETIONS, "m", prompt, session_key=session))


def role_pod(name: str, role: PodRole, port: int) -> Pod:
    pod = make_pod(name, port=port)
    return Pod(pod.id, pod.address, pod.models, role=role)


def test_session_store_ttl_slides_and_size_is_bounded() -> None:
    clock = FakeClock()
    store = SessionStore(ttl_s=10, max_sessions=2, clock=clock)
    a = Binding(PodId("ns", "a"))
    store.bind("k1", a)
    clock.now = 8
    assert store.get("k1") == a  # used: lives until 18
    clock.now = 17
    assert store.get("k1") == a
    clock.now = 40
    assert store.get("k1") is None
    for key in ("x", "y", "z"):
        store.bind(key, a)
    assert len(store) == 2 and store.get("x") is None


def test_a_bound_session_goes_to_its_pod_without_scoring() -> None:
    sched = make_scheduler(PREFIX_ONLY)
    sched.sessions = SessionStore()
    pods = [make_pod(n) for n in "abcd"]
    sched.record(cycle("other prompt " * 30, session=None), pods[3].id)  # d matches nothing here
    sched.record(cycle(), pods[1].id)  # binds s1 to b (and records its prompt)
    sched.record(cycle("the same text " * 30, session=None), pods[2].id)
    for _ in range(10):
        result = sched.schedule_request(cycle("the same text " * 30), pods)
        assert result.pinned and result.pods[0].id == pods[1].id
        assert sorted(p.id.name for p in result.pods) == list("abcd")
    unbound = sched.schedule_request(cycle("the same text " * 30, session=None), pods)
    assert not unbound.pinned and unbound.pods[0].id == pods[2].id  # scored: c matches


def test_a_bound_pod_failing_the_filters_is_scored_then_rebound() -> None:
    drop = DropFilter()
    sched = Scheduler(filters=(drop,), sessions=SessionStore())
    pods = [make_pod(n) for n in "abc"]
    sched.record(cycle(), pods[0].id)
    drop.drop = {"a"}
    result = sched.schedule_request(cycle(), pods)
    assert not result.pinned and pods[0] not in result.pods
    sched.record(cycle(), result.pods[0].id)
    drop.drop = set()
    assert sched.schedule_request(cycle(), pods).pods[0] == result.pods[0]


def test_bindings_to_removed_pods_are_forgotten() -> None:
    sched = Scheduler(sessions=SessionStore())
    pods = [make_pod(n) for n in "ab"]
    sched.record(cycle(), pods[0].id)
    sched.pods_changed(pods[1:])
    assert sched.sessions is not None and sched.sessions.get("s1") is None


def test_prefill_decode_pods_are_scored_in_separate_passes_and_both_recorded() -> None:
    sched = make_scheduler(PREFIX_ONLY, CollectorRegistry())
    decode = [role_pod(f"d{i}", PodRole.DECODE, 8000 + i) for i in range(3)]
    prefill = [role_pod(f"p{i}", PodRole.PREFILL, 9000 + i) for i in range(2)]
    pods = [*decode, *prefill]
    first = sched.schedule_request(cycle(session=None), pods)
    assert {p.role for p in first.pods} == {PodRole.DECODE} and len(first.pods) == 3
    assert first.prefill is not None and first.prefill.role is PodRole.PREFILL
    sched.record(cycle(session=None), first.pods[0].id, first.prefill.id)
    for _ in range(5):
        again = sched.schedule_request(cycle(session=None), pods)
        assert again.pods[0] == first.pods[0] and again.prefill == first.prefill


def test_a_pd_pair_is_bound_as_a_pair() -> None:
    sched = Scheduler(sessions=SessionStore())
    decode = [role_pod(f"d{i}", PodRole.DECODE, 8000 + i) for i in range(2)]
    prefill = [role_pod(f"p{i}", PodRole.PREFILL, 9000 + i) for i in range(2)]
    sched.record(cycle(), decode[1].id, prefill[0].id)
    result = sched.schedule_request(cycle(), [*decode, *prefill])
    assert result.pinned and result.pods[0] == decode[1] and result.prefill == prefill[0]


def test_prefill_pods_alone_cannot_serve() -> None:
    with pytest.raises(NoReadyPods, match="no ready decode pod"):
        Scheduler().schedule_request(cycle(), [role_pod("p0", PodRole.PREFILL, 9000)])


def test_without_prefill_pods_decode_pods_serve_alone() -> None:
    decode = [role_pod("d0", PodRole.DECODE, 8000), make_pod("both")]
    result = Scheduler().schedule_request(cycle(session=None), decode)
    assert result.prefill is None and len(result.pods) == 2
