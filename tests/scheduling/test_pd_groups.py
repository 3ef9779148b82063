"""PD groups as Kthena's ModelServer ``pdGroup``: roles and groups from labels, each
decode pod paired with the best prefill pod of its own group (``scheduler_impl.go``
Schedule, ``model_server.go`` categorizePodForPDGroup / matchesLabels)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from extproc.errors import ConfigError, NoReadyPods
from extproc.pods import Pod, PodRole
from extproc.routing.router import Router
from extproc.scheduling.config import parse_config
from extproc.scheduling.interfaces import Cycle
from extproc.scheduling.sessions import Binding, SessionStore
from testkit.factories import PREFIX_ONLY, make_cycle, make_pod, make_scheduler

GROUP = "modelserving.volcano.sh/group-name"
ROLE = "modelserving.volcano.sh/role"
PD = (
    PREFIX_ONLY
    + f"""pdGroup:
  groupKey: {GROUP}
  prefillLabels: {{{ROLE}: prefill}}
  decodeLabels: {{{ROLE}: decode}}
"""
)
PROMPT = "a shared system prompt " * 20


def pod(name: str, port: int, **labels: str) -> Pod:
    base = make_pod(name, port=port)
    keys = {"group": GROUP, "role": ROLE}
    return replace(base, labels=tuple(sorted((keys.get(k, k), v) for k, v in labels.items())))


def names(pods: list[Pod]) -> list[str]:
    return [p.id.name for p in pods]


def schedule(pods: list[Pod], held: dict[str, int], cycle: Cycle | None = None) -> object:
    """Schedule ``PROMPT`` after recording ``held[name]`` bytes of it on each pod named."""
    sched = make_scheduler(PD)
    for p in pods:
        if p.id.name in held:
            sched.record(make_cycle(PROMPT[: held[p.id.name]]), p.id)
    return sched.schedule_request(cycle or make_cycle(PROMPT), tuple(pods))


D1 = pod("d1", 8001, group="g1", role="decode")
D2 = pod("d2", 8002, group="g2", role="decode")
D3 = pod("d3", 8003, group="g1", role="decode")
P1 = pod("p1", 8011, group="g1", role="prefill")
P1B = pod("p1b", 8012, group="g1", role="prefill")
P2 = pod("p2", 8021, group="g2", role="prefill")


@pytest.mark.parametrize(
    ("pods", "held", "decode", "prefill"),
    [
        pytest.param(
            [D1, D2, D3, P1, P2],
            {"d1": 400, "d2": 300, "d3": 200},
            ["d1", "d3"],
            "p1",
            id="fallbacks-only-in-the-picks-group",
        ),
        pytest.param(
            [D1, D2, D3, P1, P1B, P2],
            {"d1": 400, "p1b": 400},
            ["d1", "d3"],
            "p1b",
            id="best-prefill-of-the-group",
        ),
        pytest.param(
            [D1, D2, D3, P2],
            {"d1": 400, "d3": 300, "d2": 200},
            ["d2"],
            "p2",
            id="group-without-prefill-skipped",
        ),
        pytest.param(
            [D1, D2, P1, P2, pod("p3", 8031, group="g3", role="prefill")],
            {"p3": 400, "d2": 400},
            ["d2"],
            "p2",
            id="prefill-of-another-group-never-paired",
        ),
        pytest.param(
            [D1, P1, pod("x", 8040, role="decode"), pod("y", 8041, group="g1")],
            {"x": 400, "y": 400},
            ["d1"],
            "p1",
            id="no-group-label-or-no-role-label-unused",
        ),
    ],
)
def test_each_decode_pod_gets_its_groups_best_prefill(
    pods: list[Pod], held: dict[str, int], decode: list[str], prefill: str
) -> None:
    result = schedule(pods, held)
    assert names(result.pods) == decode  # type: ignore[attr-defined]
    assert result.prefill.id.name == prefill  # type: ignore[attr-defined]


def test_a_pod_matching_both_label_sets_is_a_decode_pod() -> None:
    """Kthena checks decodeLabels first; an empty label set matches nothing."""
    config = PREFIX_ONLY + f"pdGroup: {{groupKey: {GROUP}, prefillLabels: {{kind: gpu}}, "
    config += "decodeLabels: {kind: gpu, tier: decode}}\n"
    sched = make_scheduler(config)
    both = pod("both", 8050, group="g1", kind="gpu", tier="decode")
    prefill_only = pod("pre", 8051, group="g1", kind="gpu")
    result = sched.schedule_request(make_cycle(PROMPT), (both, prefill_only))
    assert names(result.pods) == ["both"] and result.prefill == prefill_only
    empty = make_scheduler(PREFIX_ONLY + f"pdGroup: {{groupKey: {GROUP}}}\n")
    with pytest.raises(NoReadyPods, match="no ready decode pod"):
        empty.schedule_request(make_cycle(PROMPT), (both, prefill_only))


def test_the_pods_own_role_is_not_used_with_pd_groups() -> None:
    labelled_prefill = replace(pod("p", 8060, group="g1", role="prefill"), role=PodRole.DECODE)
    result = schedule([D1, labelled_prefill], {})
    assert names(result.pods) == ["d1"] and result.prefill.id.name == "p"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("pods", "message"),
    [
        pytest.param([P1, P2], "no ready decode pod in a PD group", id="no-decode"),
        pytest.param([D1, D2], "no valid prefill-decode pod pairs found", id="no-prefill"),
        pytest.param(
            [D1, pod("p", 8070, group="g2", role="prefill")],
            "no valid prefill-decode pod pairs found",
            id="prefill-in-another-group",
        ),
    ],
)
def test_no_pair_is_an_error(pods: list[Pod], message: str) -> None:
    with pytest.raises(NoReadyPods, match=message):
        schedule(pods, {})


def test_a_session_stays_on_its_pair() -> None:
    sched = make_scheduler(PD)
    sched.sessions = SessionStore(ttl_s=60)
    pods = (D1, D2, D3, P1, P1B, P2)
    sched.sessions.bind("s", Binding(D3.id, P1B.id))
    cycle = make_cycle(PROMPT)
    cycle.request = replace(cycle.request, session_key="s")
    result = sched.schedule_request(cycle, pods)
    assert result.pinned and result.pods[0] == D3 and result.prefill == P1B
    assert names(result.pods) in (["d3", "d1"],)  # fallbacks from the same group only


def test_the_router_counts_the_prefill_pod_in_flight() -> None:
    router = Router(make_scheduler(PD), (D1, P1), session_header=None)
    body = b'{"model": "m", "prompt": "hello"}'
    decision = router.route("/v1/completions", body, request_id="r1")
    assert decision.prefill == P1
    assert router.in_flight.get(D1.id) == 1 and router.in_flight.get(P1.id) == 1
    router.complete("r1", D1.address, succeeded=True)
    assert router.in_flight.get(D1.id) == 0 and router.in_flight.get(P1.id) == 0


@pytest.mark.parametrize(
    ("section", "message"),
    [
        pytest.param("pdGroup: [x]\n", "pdGroup: expected a mapping", id="not-a-mapping"),
        pytest.param("pdGroup: {prefillLabels: {}}\n", "pdGroup.groupKey", id="no-key"),
        pytest.param(
            "pdGroup: {groupKey: g, decodeLabels: {role: 1}}\n",
            "pdGroup.decodeLabels: expected a mapping",
            id="label-not-a-string",
        ),
    ],
)
def test_bad_sections_stop_start_up(section: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(PREFIX_ONLY + section, "cm.yaml")
