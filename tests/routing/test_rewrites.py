"""Model rewrites: the section's rules and their validation, the weighted choice, the body
rewritten, and the router routing a rewritten request to its target's pods."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import orjson
import pytest
import yaml
from prometheus_client import CollectorRegistry

from extproc.errors import ConfigError, ModelNotFound
from extproc.request.parse import parse_request
from extproc.routing.rewrites import (
    RewriteRule,
    Target,
    WatchedRules,
    check_targets,
    merged,
    parse_model_rewrites,
    rewritten_body,
)
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, parse_config
from testkit.factories import PREFIX_ONLY, make_pod

SPLIT = """
- matches: [{model: {type: Exact, value: food-review}}]
  targets:
    - {modelRewrite: food-review-v2, weight: 90}
    - {modelRewrite: food-review-v1, weight: 10}
"""


def rules(text: str) -> tuple[RewriteRule, ...]:
    return parse_model_rewrites(yaml.safe_load(text), "c.yaml")


def test_the_inference_extension_form_and_its_short_forms() -> None:
    (split,) = rules(SPLIT)
    assert split.models == ("food-review",)
    assert split.targets == (Target("food-review-v2", 90), Target("food-review-v1", 10))
    assert split.where == "c.yaml: modelRewrites[0] (food-review)"
    short, catch_all = rules("""
- matches: [{model: chat}, {model: {value: talk}}]
  targets: [{modelRewrite: a}, {modelRewrite: b}]
- targets: [{modelRewrite: base}]
""")
    assert short.models == ("chat", "talk")
    assert [t.weight for t in short.targets] == [1, 1]  # no weights: equal
    assert catch_all.models == ()
    assert parse_model_rewrites(None, "c.yaml") == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{matches: []}", r"modelRewrites must be a list of rules"),
        ("[{targets: [{modelRewrite: b}], match: x}]", r"\[0\]: unknown key 'match'"),
        (
            "[{matches: [{model: a}], targets: [{modelRewrite: b, weigth: 1}]}]",
            r"\[0\] \(a\): targets\[0\]: unknown key 'weigth'",
        ),
        ("[{matches: [{model: ''}], targets: [{modelRewrite: b}]}]", r"model must name a model"),
        ("[{matches: [{model: {value: a, type: Prefix}}], targets: []}]", r"must be Exact"),
        ("[{matches: [{model: a}, {model: a}], targets: [{modelRewrite: b}]}]", "twice"),
        ("[{matches: [{model: a}]}]", r"\(a\): targets must be a non-empty list"),
        ("[{matches: [{model: a}], targets: []}]", r"targets must be a non-empty list"),
        ("[{matches: [{model: a}], targets: [{modelRewrite: ''}]}]", r"modelRewrite must name"),
        ("[{matches: [{model: a}], targets: [{weight: 1}]}]", r"modelRewrite must name"),
        (
            "[{matches: [{model: a}], targets: [{modelRewrite: b, weight: -1}]}]",
            r"weight must be an integer from 0 to 1000000, got -1",
        ),
        ("[{matches: [{model: a}], targets: [{modelRewrite: b, weight: 0.5}]}]", "got 0.5"),
        ("[{matches: [{model: a}], targets: [{modelRewrite: b, weight: true}]}]", "got True"),
        ("[{matches: [{model: a}], targets: [{modelRewrite: b, weight: 1000001}]}]", "1000001"),
        ("[{matches: [{model: a}], targets: [{modelRewrite: b, weight: 0}]}]", "all 0"),
        (
            "[{matches: [{model: a}], targets: [{modelRewrite: b, weight: 1}, {modelRewrite: c}]}]",
            "give every target a weight, or none",
        ),
        (
            "[{matches: [{model: a}], targets: [{modelRewrite: b}, {modelRewrite: b}]}]",
            "a target model is named twice",
        ),
        (
            """
            - {matches: [{model: a}], targets: [{modelRewrite: b}]}
            - {matches: [{model: c}, {model: a}], targets: [{modelRewrite: d}]}
            """,
            (
                r"modelRewrites\[1\] \(c, a\): model 'a' is matched by "
                r"c.yaml: modelRewrites\[0\] \(a\) already"
            ),
        ),
        (
            "[{targets: [{modelRewrite: b}]}, {targets: [{modelRewrite: c}]}]",
            r"\[1\] \(any model\): any model \(no matches\) is matched by",
        ),
    ],
)
def test_bad_rules_are_refused_naming_them(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        rules(text)


def test_a_target_no_known_pod_serves_is_refused_when_pods_are_known() -> None:
    (split,) = rules(SPLIT)
    pods = [make_pod("a", model="food-review-v2"), make_pod("b", model="food-review")]
    with pytest.raises(
        ConfigError,
        match=r"\(food-review\): no known pod serves the target 'food-review-v1' "
        r"\(models served: food-review, food-review-v2\)",
    ):
        check_targets([split], pods)
    check_targets([split], [])  # none known yet: answered 404 per request instead
    pods.append(make_pod("c", model="food-review-v1"))
    check_targets([split], pods)
    (off,) = rules(
        "[{matches: [{model: a}], targets: [{modelRewrite: b, weight: 0}, "
        "{modelRewrite: c, weight: 1}]}]"
    )
    check_targets([off], [make_pod("c", model="c")])  # a target weighted 0 gets nothing


def within_4_sigma(count: int, n: int, p: float) -> bool:
    return abs(count - n * p) <= 4 * math.sqrt(n * p * (1 - p))


def test_the_split_follows_the_weights() -> None:
    (split,) = rules(SPLIT)
    draws = [split.choose(None) for _ in range(2000)]
    assert within_4_sigma(draws.count("food-review-v1"), 2000, 0.1)
    assert set(draws) == {"food-review-v1", "food-review-v2"}
    # Sessions: each key its own place in the weights, so keys split alike.
    by_session = [split.choose(f"session-{i}") for i in range(2000)]
    assert within_4_sigma(by_session.count("food-review-v1"), 2000, 0.1)


def test_a_session_sticks_to_one_target() -> None:
    (split,) = rules(SPLIT)
    for i in range(50):
        key = f"user-{i}"
        assert len({split.choose(key) for _ in range(20)}) == 1
    (zero,) = rules("[{targets: [{modelRewrite: b, weight: 0}, {modelRewrite: c, weight: 3}]}]")
    assert {zero.choose(None) for _ in range(200)} | {zero.choose(str(i)) for i in range(200)} == {
        "c"
    }


def test_file_rules_win_and_watched_objects_keep_their_order() -> None:
    file_rules = rules("[{matches: [{model: a}], targets: [{modelRewrite: from-file}]}]")
    watched = parse_model_rewrites(
        yaml.safe_load("""
- {matches: [{model: a}, {model: b}], targets: [{modelRewrite: old}]}
- {targets: [{modelRewrite: any}]}
"""),
        "k8s",
    ) + parse_model_rewrites(
        yaml.safe_load("[{matches: [{model: b}], targets: [{modelRewrite: newer}]}]"), "k8s"
    )
    table = merged(file_rules, watched)
    rule_a, rule_b, rule_other = (table.rule_for(m) for m in ("a", "b", "other"))
    assert rule_a is not None and rule_a.targets[0].model == "from-file"
    assert rule_b is not None and rule_b.targets[0].model == "old"  # the older object
    assert rule_other is not None and rule_other.targets[0].model == "any"
    assert merged((), ()).rule_for("a") is None


def test_a_watched_object_with_a_bad_rule_is_left_out_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watched = WatchedRules()
    good = ("InferenceModelRewrite ns/good", [{"targets": [{"modelRewrite": "b"}]}])
    bad = ("InferenceModelRewrite ns/bad", [{"targets": [{"modelRewrite": "c", "weight": -1}]}])
    with caplog.at_level(logging.WARNING, "extproc.routing"):
        for _ in range(3):
            (rule,) = watched.parse([good, bad])
            assert rule.where == "InferenceModelRewrite ns/good: spec.rules[0] (any model)"
    assert caplog.text.count("InferenceModelRewrite ns/bad: spec.rules[0]") == 1


CHAT = b'{"messages":[{"role":"user","content":"say \\"model\\": \\"food-review\\""}],'


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"model":"food-review","prompt":"hi"}', b'{"model":"food-review-v2","prompt":"hi"}'),
        (
            b'{ "prompt" : "x",\n  "model" :  "food-review" , "max_tokens": 5.0e0 }',
            b'{ "prompt" : "x",\n  "model" :  "food-review-v2" , "max_tokens": 5.0e0 }',
        ),
        (CHAT + b'"model":"food-review"}', CHAT + b'"model":"food-review-v2"}'),
    ],
)
def test_only_the_model_changes_byte_for_byte(body: bytes, expected: bytes) -> None:
    assert rewritten_body(body, orjson.loads(body), "food-review-v2") == expected


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"food\\u002dreview","prompt":"hi"}',  # written escaped: no plain match
        b'{"metadata":{"model":"food-review"},"model":"food-review"}',  # twice
        b'{"metadata":{"model":"food-review"},"\\u006dodel":"food-review"}',  # nested only
    ],
)
def test_a_model_not_written_plainly_once_is_reserialised(body: bytes) -> None:
    data = orjson.loads(body)
    out = rewritten_body(body, data, 'v2 "quoted"')
    assert out == orjson.dumps({**data, "model": 'v2 "quoted"'})


PODS = [
    make_pod("v2", model="food-review-v2", port=8001),
    make_pod("v1", model="food-review-v1", port=8002),
    make_pod("base", model="m", port=8003),
]


def make_router(section: str, pods: list[Any] = PODS) -> tuple[Router, CollectorRegistry]:
    registry = CollectorRegistry()
    scheduler = build_scheduler(parse_config(PREFIX_ONLY, "t.yaml"), registry)
    router = Router(scheduler, pods, registry=registry, rewrites=rules(section))
    return router, registry


def test_the_router_sends_a_matched_request_to_its_target_with_the_body_rewritten() -> None:
    router, registry = make_router(SPLIT)
    body = b'{"model": "food-review", "prompt": "hello there"}'
    targets = []
    for i in range(400):
        decision = router.route("/v1/completions", body, request_id=f"r{i}")
        assert decision.body is not None
        target = orjson.loads(decision.body)["model"]
        assert decision.pods[0].models == {target}  # scheduled over the target's pods
        assert decision.body == body.replace(b'"food-review"', f'"{target}"'.encode())
        pending = router.pending.pop(f"r{i}")
        assert pending is not None and pending.cycle.request.model == target  # recorded so
        targets.append(target)
    assert within_4_sigma(targets.count("food-review-v1"), 400, 0.1)
    for target in ("food-review-v1", "food-review-v2"):
        counted = registry.get_sample_value(
            "extproc_model_rewrites_total", {"model": "food-review", "target": target}
        )
        assert counted == targets.count(target)
    plain = router.route("/v1/completions", b'{"model": "m", "prompt": "x"}')
    assert plain.body is None and plain.pods[0].models == {"m"}  # no rule: as before


def test_a_session_header_keeps_the_request_on_one_target() -> None:
    router, _ = make_router(SPLIT)
    body = b'{"model": "food-review", "prompt": "hi"}'
    for session in ("alice", "bob", "carol"):
        seen = set()
        for _ in range(20):
            decision = router.route("/v1/completions", body, headers={"x-session-id": session})
            assert decision.body is not None
            seen.add(orjson.loads(decision.body)["model"])
        assert len(seen) == 1


def test_a_target_with_no_pod_is_answered_404_naming_the_rule() -> None:
    router, registry = make_router(
        "[{matches: [{model: a}], targets: [{modelRewrite: later}]}]", pods=PODS
    )
    with pytest.raises(
        ModelNotFound,
        match=r"the model 'a' is rewritten to 'later' \(c.yaml: modelRewrites\[0\] \(a\)\), "
        "which no pod serves",
    ):
        router.route("/v1/completions", b'{"model": "a", "prompt": "x"}')
    errors = registry.get_sample_value(
        "extproc_route_errors_total", {"status": "404", "code": "model_not_found"}
    )
    assert errors == 1


def test_a_rule_to_the_model_itself_and_reloaded_rules() -> None:
    router, _ = make_router("[{matches: [{model: m}], targets: [{modelRewrite: m}]}]")
    assert router.route("/v1/completions", b'{"model": "m", "prompt": "x"}').body is None
    router.set_rewrites(
        rules("[{matches: [{model: m}], targets: [{modelRewrite: food-review-v1}]}]")
    )
    decision = router.route("/v1/completions", b'{"model": "m", "prompt": "x"}')
    assert decision.body == b'{"model": "food-review-v1", "prompt": "x"}'
    router.set_watched_rewrites(
        parse_model_rewrites([{"targets": [{"modelRewrite": "food-review-v2"}]}], "k8s")
    )
    assert router.route("/v1/completions", b'{"model": "m", "prompt": "x"}').body == (
        b'{"model": "food-review-v1", "prompt": "x"}'  # the file's rule wins
    )
    decision = router.route("/v1/completions", b'{"model": "other", "prompt": "x"}')
    assert decision.body == b'{"model": "food-review-v2", "prompt": "x"}'  # watched catch-all


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'\xef\xbb\xbf{"model":"food-review","prompt":"hi"}', id="bom"),
        pytest.param(b'{"model":"food-review","prompt":"hi","x":NaN}', id="nan"),
        pytest.param('{"model":"food-review","prompt":"hi"}'.encode("utf-16"), id="utf-16"),
        pytest.param(
            b'{"model":"food-review","model":"food-review","prompt":"hi","seed":%s,"x":NaN}'
            % (b"9" * 30),
            id="big-int-reserialised",
        ),
    ],
)
def test_bodies_decoded_as_vllm_does_are_rewritten(body: bytes) -> None:
    """Bodies only the stdlib fallback decodes (``parse.load_body``) are rewritten too, and
    the result decodes as vLLM decodes it (issue 33: no 500 for a body vLLM serves)."""
    data = parse_request("/v1/completions", body).data
    assert data is not None
    out = json.loads(rewritten_body(body, data, "food-review-v2"))
    assert out["model"] == "food-review-v2" and out["prompt"] == "hi"
    assert out.get("seed", 0) in (0, int("9" * 30))
