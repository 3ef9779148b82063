"""Priority and fairness key from trusted headers, the objectives map and the body."""

from __future__ import annotations

from extproc.routing.flow.classify import Classifier, FlowClass, Objectives
from extproc.routing.flow.config import FAIRNESS_HEADER, OBJECTIVE_HEADER, FlowConfig

TRUSTED = frozenset({OBJECTIVE_HEADER, FAIRNESS_HEADER})


def classifier(**changes: object) -> tuple[Classifier, list[str], Objectives]:
    settings: dict[str, object] = {
        "enabled": True,
        "trusted_headers": TRUSTED,
        "objectives": {"critical": 100, "batch": -1},
        "default_priority": 0,
        "fairness_body_field": "user",
    }
    settings.update(changes)
    config = FlowConfig(**settings)  # type: ignore[arg-type]
    counted: list[str] = []
    objectives = Objectives(config.objectives)
    return Classifier(config, objectives, counted.append), counted, objectives


def test_the_objective_header_names_the_priority_and_the_fairness_header_the_flow() -> None:
    c, counted, _ = classifier()
    headers = {OBJECTIVE_HEADER: "critical", FAIRNESS_HEADER: "tenant-a"}
    assert c.classify(headers, {"user": "u"}) == FlowClass(100, "tenant-a")
    assert c.classify({OBJECTIVE_HEADER: "batch"}, {"user": "u"}) == FlowClass(-1, "u")
    assert c.classify({}, None) == FlowClass(0, "") and counted == []


def test_untrusted_headers_are_ignored() -> None:
    c, _, _ = classifier(trusted_headers=frozenset())
    headers = {OBJECTIVE_HEADER: "critical", FAIRNESS_HEADER: "tenant-a"}
    assert c.classify(headers, {"user": "u"}) == FlowClass(0, "u")


def test_unknown_and_malformed_objectives_get_the_default_and_are_counted() -> None:
    c, counted, _ = classifier(default_priority=7)
    assert c.classify({OBJECTIVE_HEADER: "gold"}, None).priority == 7
    assert c.classify({OBJECTIVE_HEADER: "Bad Name!"}, None).priority == 7
    assert c.classify({OBJECTIVE_HEADER: "x" * 300}, None).priority == 7
    assert counted == ["unknown", "malformed", "malformed"]


def test_watched_objectives_win_over_the_configured_and_follow_changes() -> None:
    c, _, objectives = classifier()
    objectives.set_watched({"critical": 50, "gold": 80})
    assert c.classify({OBJECTIVE_HEADER: "critical"}, None).priority == 50
    assert c.classify({OBJECTIVE_HEADER: "gold"}, None).priority == 80
    objectives.set_watched({})
    assert c.classify({OBJECTIVE_HEADER: "critical"}, None).priority == 100
    assert c.classify({OBJECTIVE_HEADER: "gold"}, None).priority == 0


def test_a_body_field_keys_fairness_only_when_it_is_a_string_or_number() -> None:
    c, _, _ = classifier()
    assert c.classify(None, {"user": 42}).fairness_key == "42"
    assert c.classify(None, {"user": {"id": 1}}).fairness_key == ""
    assert c.classify(None, {"user": True}).fairness_key == ""
    assert len(c.classify(None, {"user": "u" * 1000}).fairness_key) == 128
