"""Bad values fail at install time with a message naming the value and what is wrong.

values.schema.json catches types, ranges and typos; the few rules across values that a
schema cannot state are ``fail`` calls in _helpers.tpl ("extproc.validate").
"""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tests.charts.conftest import render


def score(weight: Any) -> dict[str, Any]:
    return {"plugins": {"Score": {"enabled": [{"name": "prefix-cache", "weight": weight}]}}}


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
    ],
)
def test_cross_value_rules_fail_with_what_to_change(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(values)


def test_network_policy_can_be_turned_off_in_external_mode() -> None:
    docs = render({"mode": "external", "networkPolicy": {"enabled": False}})
    assert "NetworkPolicy" not in {d["kind"] for d in docs}
