"""Bad values fail at install time with a message naming the value and what is wrong.

values.schema.json catches types, ranges and typos; the few rules across values that a
schema cannot state are ``fail`` calls in _helpers.tpl ("extproc.validate").
"""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from testkit.chart import PRECISE, render


def score(weight: Any) -> dict[str, Any]:
    return {"plugins": {"Score": {"enabled": [{"name": "prefix-cache", "weight": weight}]}}}


def kv_events(**changes: Any) -> dict[str, Any]:
    """values-precise.yaml's kvEvents with ``changes``."""
    return {"kvEvents": {**PRECISE["kvEvents"], **changes}}


def tokenizers(**changes: Any) -> dict[str, Any]:
    return kv_events(tokenizers={**PRECISE["kvEvents"]["tokenizers"], **changes})


def precise_models(models: dict[str, str]) -> dict[str, Any]:
    """values-precise.yaml with the plugin's ``models`` map replaced."""
    config = [
        {"name": c["name"], "args": {**c["args"], "models": models}}
        if c["name"] == "precise-prefix-cache"
        else c
        for c in PRECISE["scheduler"]["pluginConfig"]
    ]
    return {**PRECISE, "scheduler": {**PRECISE["scheduler"], "pluginConfig": config}}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param({"mode": "sidecar"}, "at '/mode': value must be one of", id="mode"),
        pytest.param({"replica": 2}, "additional properties 'replica' not allowed", id="typo"),
        pytest.param(
            {"scheduler": score(0)},
            "at '/scheduler/plugins/Score/enabled/0/weight': minimum: got 0, want 1",
            id="weight-zero",
        ),
        pytest.param(
            {"scheduler": {"plugins": {"Score": {"enabled": [{"name": "prefix-cache"}]}}}},
            "missing property 'weight'",
            id="weight-missing",
        ),
        pytest.param({"scheduler": score("1")}, "got string, want integer", id="weight-string"),
        pytest.param(
            {"modelServers": {"matchLabels": {"app": None}}},
            "at '/modelServers/matchLabels': minProperties: got 0, want 1",
            id="no-selector",
        ),
        pytest.param(
            {"modelServers": {"matchLabels": {"app": "v llm"}}},
            "at '/modelServers/matchLabels/app'",
            id="bad-label-value",
        ),
        pytest.param(
            {"modelServers": {"targetPort": 70000}},
            "at '/modelServers/targetPort': maximum",
            id="port",
        ),
        pytest.param(
            {"picker": {"sessionHeader": "X-Session-Id"}},
            "at '/picker/sessionHeader'",
            id="header-uppercase",
        ),
        pytest.param(
            {"picker": {"numFallbacks": -1}}, "at '/picker/numFallbacks': minimum", id="fallbacks"
        ),
        pytest.param(
            {"envoy": {"messageTimeoutSeconds": 0}},
            "at '/envoy/messageTimeoutSeconds': exclusiveMinimum",
            id="timeout",
        ),
        pytest.param(
            {"inferencePool": {"failureMode": "Open"}},
            "at '/inferencePool/failureMode'",
            id="failure-mode",
        ),
        pytest.param(
            kv_events(topology="pub"),
            "at '/kvEvents/topology': value must be one of",
            id="topology",
        ),
        pytest.param(kv_events(port=0), "at '/kvEvents/port': minimum", id="events-port"),
        pytest.param(
            kv_events(replayPort="5558"), "at '/kvEvents/replayPort'", id="replay-port-string"
        ),
        pytest.param(
            kv_events(replayPort=70000), "at '/kvEvents/replayPort': maximum", id="replay-port"
        ),
        pytest.param(
            {"kvEvents": {"enable": True}},
            "additional properties 'enable' not allowed",
            id="events-typo",
        ),
        pytest.param(
            tokenizers(volume={"hostPath": {"path": "/srv/tokenizers"}}),
            "at '/kvEvents/tokenizers/volume': 'not' failed",
            id="host-path",
        ),
        pytest.param(
            tokenizers(volume={"persistentVolumeClaim": {"claimName": "a"}, "emptyDir": {}}),
            "at '/kvEvents/tokenizers/volume': maxProperties",
            id="two-volume-sources",
        ),
        pytest.param(
            tokenizers(mountPath="models"),
            "at '/kvEvents/tokenizers/mountPath'",
            id="relative-mount",
        ),
        pytest.param(
            tokenizers(mountPath="/etc/extproc/models"),
            "at '/kvEvents/tokenizers/mountPath': 'not' failed",
            id="mount-over-config",
        ),
        pytest.param(
            {"picker": {"extraArgs": ["--kv-events-port=6000"]}},
            "at '/picker/extraArgs/0'",
            id="events-flag-in-extra-args",
        ),
    ],
)
def test_schema_rejects(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match="values don't meet the spec") as exc:
        render(values)
    assert message in str(exc.value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param(
            {"mode": "external"},
            "networkPolicy.gatewayFrom is empty: in external mode, list the NetworkPolicyPeers",
            id="external-without-gateway-peers",
        ),
        pytest.param(
            {
                "mode": "gateway",
                "networkPolicy": {"enabled": False},
                "inferencePool": {"httpRoute": {"enabled": True}},
            },
            "inferencePool.httpRoute.parentRefs is empty",
            id="route-without-gateway",
        ),
        pytest.param(
            {"scheduler": PRECISE["scheduler"]},
            "scheduler scores with precise-prefix-cache, which reads the model servers' KV events",
            id="precise-without-events",
        ),
        pytest.param(
            kv_events(),
            "kvEvents.enabled: the events feed the precise-prefix-cache plugin",
            id="events-without-precise",
        ),
        pytest.param(
            {**PRECISE, **tokenizers(volume={})},
            "kvEvents.tokenizers.volume is empty",
            id="no-tokenizer-volume",
        ),
        pytest.param(precise_models({}), "precise-prefix-cache has no models", id="no-models"),
        pytest.param(
            precise_models({"qwen3": "/models/qwen3", "llama": "/srv/llama"}),
            r"models.llama is /srv/llama, outside kvEvents.tokenizers.mountPath \(/models\)",
            id="model-outside-the-mount",
        ),
        pytest.param(
            precise_models({"qwen3": "/modelsx/qwen3"}),
            "models.qwen3 is /modelsx/qwen3, outside",
            id="model-beside-the-mount",
        ),
        pytest.param(
            {**PRECISE, **kv_events(topology="bind"), "replicas": 2},
            "kvEvents.topology bind takes one replica",
            id="bind-with-replicas",
        ),
        pytest.param(
            {**PRECISE, **kv_events(topology="bind", port=9090)},
            "kvEvents.port 9090 is one of extproc's own ports",
            id="bind-on-metrics-port",
        ),
        pytest.param(
            {**PRECISE, **kv_events(replayPort=5557)},
            "kvEvents.replayPort equals kvEvents.port",
            id="replay-on-events-port",
        ),
    ],
)
def test_cross_value_rules_fail_with_what_to_change(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(values)


@pytest.mark.parametrize(
    "values",
    [
        pytest.param(precise_models({"qwen3": "/models"}), id="model-at-the-mount-root"),
        pytest.param({**PRECISE, **kv_events(topology="bind", port=9002 + 1000)}, id="bind"),
        pytest.param({**PRECISE, **kv_events(topology="bind", replayPort=5557)}, id="bind-replay"),
    ],
)
def test_precise_values_the_rules_accept(values: dict[str, Any]) -> None:
    assert render(values)


def test_network_policy_can_be_turned_off_in_external_mode() -> None:
    docs = render({"mode": "external", "networkPolicy": {"enabled": False}})
    assert "NetworkPolicy" not in {d["kind"] for d in docs}
