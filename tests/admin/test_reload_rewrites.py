"""The modelRewrites section on reload: a valid change applied at once, a bad rule or a
target no known pod serves refused with the rules in force kept; /debug/config echoes
the rules in force."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.admin.reload import ConfigReloader
from extproc.admin.state import config_state
from extproc.routing.rewrites import parse_model_rewrites
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, config_text, parse_config
from testkit.factories import PREFIX_ONLY, make_pod

PODS = [make_pod("v1", model="m-v1", port=8001), make_pod("v2", model="m-v2", port=8002)]


def with_rule(target: str, weight: object = 1) -> str:
    return PREFIX_ONLY + (
        f"modelRewrites:\n  - matches: [{{model: m}}]\n"
        f"    targets: [{{modelRewrite: {target}, weight: {weight}}}]\n"
    )


def start(tmp_path: Path, text: str) -> tuple[Router, ConfigReloader, Path, CollectorRegistry]:
    file = tmp_path / "config.yaml"
    file.write_text(text)
    registry = CollectorRegistry()
    text, source = config_text(file)
    config = parse_config(text, source)
    rules = parse_model_rewrites(config.model_rewrites, source)
    router = Router(build_scheduler(config, registry), PODS, registry=registry, rewrites=rules)
    return router, ConfigReloader(router, file, text, config, registry, poll_s=0), file, registry


def routed_to(router: Router) -> str:
    decision = router.route("/v1/completions", b'{"model": "m", "prompt": "p"}')
    assert decision.body is not None
    model: str = orjson.loads(decision.body)["model"]
    return model


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (with_rule("m-v3"), "no known pod serves the target 'm-v3'"),
        (with_rule("m-v2", -1), "weight must be an integer from 0 to 1000000, got -1"),
        (PREFIX_ONLY + "modelRewrites: {m: m-v2}\n", "modelRewrites must be a list of rules"),
    ],
)
def test_a_bad_rule_is_refused_and_a_good_one_applied(
    tmp_path: Path, bad: str, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    router, reloader, file, registry = start(tmp_path, with_rule("m-v1"))
    assert routed_to(router) == "m-v1"
    file.write_text(bad)
    assert reloader.reload_now() == "invalid"
    assert message in caplog.text
    assert routed_to(router) == "m-v1"  # the rules in force stay
    file.write_text(with_rule("m-v2"))
    assert reloader.reload_now() == "applied"
    assert routed_to(router) == "m-v2"
    counted = registry.get_sample_value("extproc_config_reloads_total", {"result": "invalid"})
    assert counted == 1


def test_debug_config_echoes_the_rules_in_force(tmp_path: Path) -> None:
    router, _, _, _ = start(tmp_path, with_rule("m-v2", 3))
    router.set_watched_rewrites(
        parse_model_rewrites([{"targets": [{"modelRewrite": "m-v1"}]}], "InferenceModelRewrite x")
    )
    source = str(tmp_path / "config.yaml")
    assert config_state(router, source)["modelRewrites"] == [
        {
            "matches": [{"model": {"type": "Exact", "value": "m"}}],
            "targets": [{"modelRewrite": "m-v2", "weight": 3}],
            "from": f"{source}: modelRewrites[0] (m)",
        },
        {
            "matches": [],
            "targets": [{"modelRewrite": "m-v1", "weight": 1}],
            "from": "InferenceModelRewrite x: modelRewrites[0] (any model)",
        },
    ]
