"""``/debug/pick``'s explanation (``routing.explain`` over ``Scheduler.explain``): the pick
the router would make, every filter's and scorer's part, the cost terms, and nothing
recorded, credited or counted."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extproc.pods import PodMetrics, PodRole
from extproc.routing.explain import explain_pick
from extproc.routing.flow.config import FlowConfig
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, parse_config
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import Cycle
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT
from extproc.scheduling.sessions import SessionStore
from testkit.estimated_ttft import costs
from testkit.factories import make_pod
from tests.admin.explain_setup import SHARED, TTFT_AND_FILTER

PATH = "/v1/chat/completions"
PREFIX = "scheduler: {plugins: {Score: {enabled: [{name: prefix-cache, weight: 1}]}}}"


def pods(waiting: tuple[int, ...] = (0, 0, 0, 0)) -> list[Any]:
    return [
        make_pod(f"p{i}", port=8000 + i, metrics=PodMetrics(waiting=w))
        for i, w in enumerate(waiting)
    ]


def make_router(config: str = TTFT_AND_FILTER, **kw: Any) -> Router:
    registry = CollectorRegistry()
    in_flight = InFlight()
    sessions = kw.pop("sessions", None)
    scheduler = build_scheduler(parse_config(config, "t.yaml"), registry, in_flight, sessions)
    router = Router(
        scheduler,
        kw.pop("pod_list", pods()),
        registry=registry,
        in_flight=in_flight,
        **kw,
    )
    return router


def chat(question: str, system: str = SHARED) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return json.dumps({"model": "m", "messages": messages}).encode()


def served(router: Router, body: bytes, request_id: str) -> str:
    """Route ``body`` and end it successfully on its pick; the pick's id."""
    decision = router.route(PATH, body, request_id=request_id)
    router.complete(request_id, decision.pods[0].address, True)
    return str(decision.pods[0].id)


def test_explain_picks_what_the_next_request_gets_when_nothing_ties() -> None:
    router = make_router()
    warm = served(router, chat("first question"), "r1")
    answer = explain_pick(router, PATH, chat("second question"))
    assert answer["status"] == 200
    assert answer["ties"] == [] or all(warm not in group for group in answer["ties"])
    assert answer["pick"] == warm
    assert answer["pods"][0]["id"] == warm and answer["pods"][0]["rank"] == 1
    real = router.route(PATH, chat("second question"), request_id="r2")
    assert str(real.pods[0].id) == answer["pick"]
    assert answer["order"][: 1 + router.num_fallbacks] == [answer["pick"], *answer["fallbacks"]]


def test_explain_records_credits_and_counts_nothing() -> None:
    router = make_router(sessions=SessionStore())
    served(router, chat("first question"), "r1")
    plugin = next(
        ws.scorer for ws in router.scheduler.scorers if ws.scorer.type_name == "estimated-ttft"
    )
    assert isinstance(plugin, EstimatedTTFT)
    registry_before = _decided(router)
    entries, written = (
        plugin.index.num_entries,
        plugin.written.relative([p.id for p in router.pods]),
    )
    body = chat("another question")
    answer = explain_pick(router, PATH, body, {"x-session-id": "s1"})
    assert answer["status"] == 200
    assert len(router.pending) == 0
    assert router.in_flight.snapshot() == {}
    assert plugin.arrivals.num_requests == 0
    assert plugin.index.num_entries == entries
    assert plugin.written.relative([p.id for p in router.pods]) == written
    assert router.scheduler.sessions is not None
    assert router.scheduler.sessions.get("s1") is None
    assert _decided(router) == registry_before


def _decided(router: Router) -> float:
    return sum(m.samples[0].value for m in router.metrics.scheduling.collect() if m.samples)


def test_every_filter_verdict_and_scorer_score_per_pod() -> None:
    router = make_router(pod_list=pods((0, 9, 0, 0)))  # p1 waits past maxWaitingRequests
    answer = explain_pick(router, PATH, chat("a question"))
    by_id = {p["id"]: p for p in answer["pods"]}
    assert by_id["default/p1"]["verdict"] == "removed"
    assert by_id["default/p1"]["removed_by"] == "least-request"
    assert by_id["default/p1"]["rank"] is None and by_id["default/p1"]["scores"] == {}
    kept = [p for p in answer["pods"] if p["verdict"] == "kept"]
    assert [p["rank"] for p in kept] == [1, 2, 3]
    for p in kept:
        assert set(p["scores"]) == {"estimated-ttft", "least-request"}
        assert p["scores"]["estimated-ttft"]["weight"] == 2
        assert p["total"] == sum(s["weighted"] for s in p["scores"].values())
    filters = answer["passes"][0]["filters"]
    assert filters == [
        {
            "name": "least-request",
            "kept": ["default/p0", "default/p2", "default/p3"],
            "removed": ["default/p1"],
        }
    ]


def test_cost_terms_are_the_costs_the_plugin_scores_from() -> None:
    router = make_router()
    served(router, chat("first question"), "r1")
    router.in_flight.start(router.pods[2].id, 500)  # a request of another replica's kind
    answer = explain_pick(router, PATH, chat("second question"))
    plugin = next(
        ws.scorer for ws in router.scheduler.scorers if ws.scorer.type_name == "estimated-ttft"
    )
    assert isinstance(plugin, EstimatedTTFT)
    request_cycle = Cycle(router._begin(PATH, chat("second question"), None, None)[0].request)
    expected = costs(plugin, request_cycle, router.pods)
    for p in answer["pods"]:
        terms = p["cost"]["estimated-ttft"]
        pod_id = next(x.id for x in router.pods if str(x.id) == p["id"])
        assert terms["cost_ms"] == pytest.approx(expected[pod_id], abs=0.01)
        assert terms["est_ms"] == pytest.approx(
            terms["prefill_ms"] + terms["queued_ms"] + terms["running_ms"], abs=0.01
        )
    by_id = {p["id"]: p for p in answer["pods"]}
    assert by_id["default/p2"]["cost"]["estimated-ttft"]["in_flight"] == 1
    assert by_id["default/p2"]["cost"]["estimated-ttft"]["in_flight_tokens"] == 500
    warm = answer["pick"]
    assert by_id[warm]["cost"]["estimated-ttft"]["affinity"] == 1
    assert by_id[warm]["predicted_cached_tokens"] > 0
    assert (
        by_id[warm]["predicted_cached_tokens"]
        == by_id[warm]["cost"]["estimated-ttft"]["cached_tokens"]
    )


ADMIN_PAGE = Path(__file__).resolve().parents[2] / "docs" / "operations" / "admin.md"


def test_the_admin_page_shows_every_cost_term() -> None:
    """docs/operations/admin.md's example answer names the cost terms explain gives."""
    example = re.search(r'"estimated-ttft": \{\n(.*?)\n\s*\}', ADMIN_PAGE.read_text(), re.DOTALL)
    assert example is not None, "admin.md lost its example of the cost terms"
    documented = set(re.findall(r'"(\w+)":', example.group(1)))
    answer = explain_pick(make_router(), PATH, chat("q"))
    assert documented == set(answer["pods"][0]["cost"]["estimated-ttft"])


def test_equal_pods_are_said_to_tie() -> None:
    router = make_router(PREFIX)
    answer = explain_pick(router, PATH, chat("q"))
    assert answer["ties"] == [sorted(answer["ties"][0], key=answer["order"].index)]
    assert sorted(answer["ties"][0]) == [f"default/p{i}" for i in range(4)]


def test_prefill_pod_named_with_disaggregation() -> None:
    prefill = [replace(make_pod(f"pf{i}", port=8010 + i), role=PodRole.PREFILL) for i in (0, 1)]
    pod_list = [make_pod("d0", port=8000), make_pod("d1", port=8001), *prefill]
    router = make_router(PREFIX, pod_list=pod_list)
    answer = explain_pick(router, PATH, chat("q"))
    assert answer["prefill"] in {"default/pf0", "default/pf1"}
    assert {p["id"] for p in answer["pods"]} == {"default/d0", "default/d1"}
    assert [p["role"] for p in answer["passes"]] == ["serving", "prefill"]


def test_a_body_naming_no_model_is_explained_as_routed_for_the_pools_model() -> None:
    router = make_router()
    warm = served(router, chat("which model?"), "r1")  # the same prompt, naming "m"
    body = json.dumps({k: v for k, v in json.loads(chat("which model?")).items() if k != "model"})
    answer = explain_pick(router, PATH, body.encode())
    assert answer["status"] == 200 and answer["pick"] == warm  # hashed as m's


def test_a_request_the_router_would_refuse_is_explained_as_its_error() -> None:
    router = make_router()
    assert explain_pick(router, PATH, b"{oops")["status"] == 400
    unknown = explain_pick(
        router, "/v1/completions", json.dumps({"model": "x", "prompt": "hi"}).encode()
    )
    assert unknown["status"] == 404 and unknown["error"]
    full = make_router(pod_list=pods((9, 9, 9, 9)))
    refused = explain_pick(full, PATH, chat("q"))
    assert refused["status"] == 429 and "least-request" in refused["error"]
    assert refused["passes"][0]["filters"][0]["kept"] == []


def test_flow_control_says_whether_it_would_hold() -> None:
    flow = FlowConfig(enabled=True, max_waiting=0, scraped=False)
    router = make_router(PREFIX, flow=flow)
    assert explain_pick(router, PATH, chat("q"))["flow_control"]["would_hold"] is False
    for pod in router.pods:
        router.in_flight.start(pod.id, 10)
    state = explain_pick(router, PATH, chat("q"))["flow_control"]
    assert state == {
        "enabled": True,
        "priority": 0,
        "saturated": True,
        "held_now": 0,
        "would_hold": True,
    }


def test_the_request_path_draws_no_differently_for_explain_being_there() -> None:
    """``schedule_request`` (trace None) and ``explain`` order alike from one seed."""
    router = make_router(PREFIX)
    router.scheduler.rng = random.Random(7)
    explained = explain_pick(router, PATH, chat("q"))["order"]
    router.scheduler.rng = random.Random(7)
    routed = router.route(PATH, chat("q"))
    assert [str(p.id) for p in routed.pods] == explained[: 1 + router.num_fallbacks]


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize("config", [TTFT_AND_FILTER, PREFIX])
def test_explain_changes_no_metric(config: str) -> None:
    """Not the match-ratio histograms, the plugin timer or the router's counters."""
    registry = CollectorRegistry()
    in_flight = InFlight()
    scheduler = build_scheduler(parse_config(config, "t.yaml"), registry, in_flight)
    router = Router(scheduler, pods(), registry=registry, in_flight=in_flight)
    served(router, chat("first question"), "r1")
    before = samples(registry)
    assert explain_pick(router, PATH, chat("second question"))["status"] == 200
    assert explain_pick(router, PATH, b"{oops")["status"] == 400
    assert samples(registry) == before
    router.route(PATH, chat("second question"))  # the control: a real pick observes
    assert samples(registry) != before


GROUP, ROLE = "modelserving.volcano.sh/group-name", "modelserving.volcano.sh/role"
PD_GROUPS = (
    PREFIX
    + f"\npdGroup: {{groupKey: {GROUP}, prefillLabels: {{{ROLE}: prefill}}, "
    + f"decodeLabels: {{{ROLE}: decode}}}}\n"
)


def labelled(name: str, port: int, group: str, role: str) -> Any:
    return replace(make_pod(name, port=port), labels=((GROUP, group), (ROLE, role)))


def test_pd_groups_name_the_decode_pass_and_each_groups_prefill_pass() -> None:
    pod_list = [
        labelled("d1", 8001, "g1", "decode"),
        labelled("d2", 8002, "g2", "decode"),
        labelled("p1", 8011, "g1", "prefill"),
        labelled("p2", 8021, "g2", "prefill"),
    ]
    router = make_router(PD_GROUPS, pod_list=pod_list)
    served(router, chat("first"), "r1")  # warms one decode pod (and its prefill pod)
    answer = explain_pick(router, PATH, chat("second"))
    group = "g1" if answer["pick"] == "default/d1" else "g2"
    assert answer["prefill"] == f"default/p{group[1]}"
    assert answer["passes"][0]["role"] == "decode"
    assert f"prefill of group {group}" in [p["role"] for p in answer["passes"]]
    real = router.route(PATH, chat("second"), request_id="r2")
    assert str(real.pods[0].id) == answer["pick"]
    assert real.prefill is not None and str(real.prefill.id) == answer["prefill"]


def test_a_bound_session_is_explained_as_pinned() -> None:
    router = make_router(PREFIX, sessions=SessionStore())
    decision = router.route(PATH, chat("first"), request_id="r1", headers={"x-session-id": "s"})
    router.complete("r1", decision.pods[0].address, True)
    answer = explain_pick(router, PATH, chat("second"), {"x-session-id": "s"})
    assert answer["pinned"] is True and answer["pick"] == str(decision.pods[0].id)
