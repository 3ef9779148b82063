"""Kubernetes objects -> Pod / PodTarget: every rule of ``k8s_objects``."""

from __future__ import annotations

from typing import Any, cast

import pytest
from lightkube.core.selector import build_selector
from lightkube.resources.core_v1 import Pod as K8sPod

from extproc.datalayer.k8s_objects import (
    PodMapping,
    PodTarget,
    make_pods,
    make_snapshot,
    parse_pool,
    parse_selector,
    pod_warnings,
)
from extproc.pods import RANK_LABEL, Pod, PodId, PodRole
from tests.datalayer.fake_kube import inference_pool, k8s_pod

MAPPING = PodMapping()


def with_ports(pool: dict[str, Any], *ports: int) -> dict[str, Any]:
    pool["spec"]["targetPorts"] = [{"number": port} for port in ports]
    return pool


def convert(obj: dict[str, Any], mapping: PodMapping = MAPPING) -> Pod | None:
    """The pod's one endpoint on port 8000, None for none."""
    pods = convert_ports(obj, (8000,), mapping)
    assert len(pods) <= 1
    return pods[0] if pods else None


def convert_ports(
    obj: dict[str, Any], ports: tuple[int, ...], mapping: PodMapping = MAPPING
) -> tuple[Pod, ...]:
    return make_pods(cast(K8sPod, K8sPod.from_dict(obj)), mapping, ports)


def test_ready_pod() -> None:
    pod = convert(k8s_pod("p0", "10.1.2.3", labels={"app": "vllm", "extproc.io/model": "m"}))
    assert pod == Pod(
        id=PodId("ns", "p0"),
        address="10.1.2.3:8000",
        models=frozenset({"m"}),
        labels=(("app", "vllm"), ("extproc.io/model", "m")),
        role=PodRole.BOTH,
        ready=True,
    )


@pytest.mark.parametrize(
    ("obj", "ready"),
    [
        pytest.param(k8s_pod("p", ready=False), False, id="ready-condition-false"),
        pytest.param(k8s_pod("p", deleting=True), False, id="terminating"),
        pytest.param(k8s_pod("p", phase="Pending", ready=False), False, id="pending-with-ip"),
    ],
)
def test_readiness(obj: dict[str, Any], ready: bool) -> None:
    pod = convert(obj)
    assert pod is not None and pod.ready is ready


def test_no_conditions_is_not_ready() -> None:
    obj = k8s_pod("p")
    del obj["status"]["conditions"]
    pod = convert(obj)
    assert pod is not None and not pod.ready


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(k8s_pod("p", ip=None, ready=False), id="no-ip-yet"),
        pytest.param(k8s_pod("p", phase="Succeeded", ready=False), id="succeeded"),
        pytest.param(k8s_pod("p", phase="Failed", ready=False), id="failed"),
        pytest.param(k8s_pod("p", ip="not-an-ip"), id="bad-ip"),
    ],
)
def test_unroutable_pods_are_skipped(obj: dict[str, Any]) -> None:
    assert convert(obj) is None


def test_ipv6_address() -> None:
    pod = convert(k8s_pod("p", "fd00::0001"))
    assert pod is not None and pod.address == "[fd00::1]:8000"


@pytest.mark.parametrize(
    ("labels", "annotations", "default_model", "models"),
    [
        pytest.param(
            {}, {"extproc.io/models": "org/a, b,,"}, None, {"org/a", "b"}, id="annotation"
        ),
        pytest.param(
            {"extproc.io/model": "l"}, {"extproc.io/models": "a"}, None, {"a"}, id="annotation-wins"
        ),
        pytest.param({"extproc.io/model": "l"}, {}, "d", {"l"}, id="label-before-default"),
        pytest.param({}, {}, "base", {"base"}, id="default-model"),
        pytest.param({}, {}, None, set(), id="none"),
    ],
)
def test_models(
    labels: dict[str, str],
    annotations: dict[str, str],
    default_model: str | None,
    models: set[str],
) -> None:
    mapping = PodMapping(default_model=default_model)
    pod = convert(k8s_pod("p", labels=labels, annotations=annotations), mapping)
    assert pod is not None and pod.models == models


def test_custom_keys() -> None:
    mapping = PodMapping(
        model_annotation="a/models",
        model_label="a/model",
        role_label="modelserving.volcano.sh/role",
    )
    obj = k8s_pod("p", labels={"a/model": "x", "modelserving.volcano.sh/role": "prefill"})
    pod = convert(obj, mapping)
    assert pod is not None and pod.models == {"x"} and pod.role is PodRole.PREFILL


@pytest.mark.parametrize(
    ("value", "role"),
    [
        pytest.param("prefill", PodRole.PREFILL, id="prefill"),
        pytest.param("decode", PodRole.DECODE, id="decode"),
        pytest.param("both", PodRole.BOTH, id="both"),
        pytest.param(None, PodRole.BOTH, id="missing"),
        pytest.param("leader", PodRole.BOTH, id="unknown"),
    ],
)
def test_role(value: str | None, role: PodRole) -> None:
    labels = {"extproc.io/model": "m"} | ({"llm-d.ai/role": value} if value else {})
    pod = convert(k8s_pod("p", labels=labels))
    assert pod is not None and pod.role is role


def test_warnings() -> None:
    pod = convert(k8s_pod("p", labels={"llm-d.ai/role": "leader"}))
    assert pod is not None
    problems = pod_warnings(pod, MAPPING)
    assert len(problems) == 2
    assert "no served model" in problems[0] and "extproc.io/models" in problems[0]
    assert "'leader' is not prefill|decode|both" in problems[1]
    good = convert(k8s_pod("q"))
    assert good is not None and pod_warnings(good, MAPPING) == []


def test_snapshot_sorts_and_keeps_one_pod_per_address() -> None:
    pods = [
        convert(k8s_pod("b", "10.0.0.2")),
        convert(k8s_pod("c", "10.0.0.1", ready=False)),
        convert(k8s_pod("d", "10.0.0.1")),  # ready: wins over c
        convert(k8s_pod("a", "10.0.0.3")),
        convert(k8s_pod("e", "10.0.0.3")),  # both ready: the first by id (a) wins
    ]
    kept, dropped = make_snapshot(p for p in pods if p is not None)
    assert [p.id.name for p in kept] == ["a", "b", "d"]
    assert [p.id.name for p in dropped] == ["c", "e"]


@pytest.mark.parametrize(
    ("obj", "target"),
    [
        pytest.param(
            inference_pool("p", {"b": "2", "a": "1"}, 8000),
            PodTarget("a=1,b=2", (8000,)),
            id="v1",
        ),
        pytest.param(
            inference_pool("p", {"app": "x"}, 9000, v1=False),
            PodTarget("app=x", (9000,)),
            id="v1alpha2",
        ),
        pytest.param(
            with_ports(inference_pool("p", {"app": "x"}, 0), 8001, 8000, 8002),
            PodTarget("app=x", (8001, 8000, 8002)),
            id="v1-ranks-in-order",
        ),
    ],
)
def test_parse_pool(obj: dict[str, Any], target: PodTarget) -> None:
    assert parse_pool(obj) == target


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param({"targetPorts": [{"number": 1}]}, "no labels", id="no-selector"),
        pytest.param(
            {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]},
            "no labels",
            id="empty-match-labels",
        ),
        pytest.param(
            {"selector": {"matchLabels": {"a": 1}}, "targetPorts": [{"number": 1}]},
            "strings",
            id="non-string-value",
        ),
        pytest.param({"selector": {"a": "b"}}, "no target port", id="no-port"),
        pytest.param({"selector": {"a": "b"}, "targetPortNumber": 0}, "got 0", id="port-zero"),
        pytest.param({"selector": {"a": "b"}, "targetPortNumber": True}, "True", id="port-bool"),
        pytest.param(
            {"selector": {"a": "b"}, "targetPorts": [{"number": 70000}]}, "70000", id="port-big"
        ),
        pytest.param(
            {"selector": {"a": "b"}, "targetPorts": [{"number": 8000}, {"number": 0}]},
            r"targetPorts\[1\]\.number\), got 0",
            id="second-port-zero",
        ),
        pytest.param(
            {"selector": {"a": "b"}, "targetPorts": [{"number": 8000}, 8001]},
            r"targetPorts\[1\]\.number\), got None",
            id="port-not-a-mapping",
        ),
        pytest.param(
            {"selector": {"a": "b"}, "targetPorts": [{"number": 8000}, {"number": 8000}]},
            r"targetPorts: \[8000\] listed more than once",
            id="duplicate-port",
        ),
    ],
)
def test_parse_pool_errors(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_pool({"spec": spec})


@pytest.mark.parametrize(
    ("text", "encoded"),
    [
        pytest.param("app=vllm", "app=vllm", id="equal"),
        pytest.param("a==x, b!=y", "a=x,b!=y", id="double-equal-and-not-equal"),
        pytest.param("tier in (a, b),zone notin (c)", "tier in (a,b),zone notin (c)", id="sets"),
        pytest.param("gpu,!spot", "gpu,!spot", id="exists"),
        pytest.param("example.com/role=prefill", "example.com/role=prefill", id="prefixed-key"),
    ],
)
def test_parse_selector(text: str, encoded: str) -> None:
    assert build_selector(parse_selector(text)) == encoded


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("a=b,a=c", "a appears twice", id="repeated"),
        pytest.param("a=b c", "cannot parse 'a=b c'", id="junk"),
        pytest.param("!a=b", "cannot parse", id="not-with-value"),
        pytest.param("", "cannot parse ''", id="empty"),
    ],
)
def test_parse_selector_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_selector(text)


def test_every_target_port_is_a_rank_of_its_own() -> None:
    obj = k8s_pod("p0", "10.1.2.3", labels={"extproc.io/model": "m"})
    rank0, rank1 = convert_ports(obj, (8000, 8001))
    assert rank0 == Pod(
        id=PodId("ns", "p0-rank-0"),
        address="10.1.2.3:8000",
        models=frozenset({"m"}),
        labels=((RANK_LABEL, "0"), ("extproc.io/model", "m")),
    )
    assert (rank1.id.name, rank1.address, rank1.label(RANK_LABEL)) == (
        "p0-rank-1",
        "10.1.2.3:8001",
        "1",
    )


def test_ranks_of_an_ipv6_pod_share_its_readiness() -> None:
    pods = convert_ports(k8s_pod("p", "fd00::1", ready=False), (1, 2))
    assert [(p.address, p.ready) for p in pods] == [("[fd00::1]:1", False), ("[fd00::1]:2", False)]


def test_an_unroutable_pod_has_no_ranks() -> None:
    assert convert_ports(k8s_pod("p", ip=None, ready=False), (8000, 8001)) == ()


def test_snapshot_of_ranks_keeps_each_port() -> None:
    ranks = convert_ports(k8s_pod("b", "10.0.0.2"), (8000, 8001))
    solo = convert(k8s_pod("a", "10.0.0.2"))
    assert solo is not None
    kept, dropped = make_snapshot([*ranks, solo])
    assert [(p.id.name, p.address) for p in kept] == [
        ("a", "10.0.0.2:8000"),
        ("b-rank-1", "10.0.0.2:8001"),
    ]
    assert [p.id.name for p in dropped] == ["b-rank-0"]


@pytest.mark.parametrize(
    ("annotations", "models", "adapters"),
    [
        pytest.param(
            {"extproc.io/adapters": "sql-lora, org/chat-lora,,"},
            {"base", "sql-lora", "org/chat-lora"},
            {"sql-lora", "org/chat-lora"},
            id="adapters",
        ),
        pytest.param(
            {"extproc.io/models": "base,sql-lora", "extproc.io/adapters": "sql-lora"},
            {"base", "sql-lora"},
            {"sql-lora"},
            id="adapter-also-a-model",
        ),
        pytest.param({}, {"base"}, set(), id="none"),
        pytest.param({"extproc.io/adapters": ""}, {"base"}, set(), id="empty"),
    ],
)
def test_adapters(annotations: dict[str, str], models: set[str], adapters: set[str]) -> None:
    mapping = PodMapping(default_model="base")
    pods = convert_ports(k8s_pod("p", labels={}, annotations=annotations), (8000, 8001), mapping)
    assert [(set(p.models), set(p.adapters)) for p in pods] == [(models, adapters)] * 2


def test_custom_adapter_annotation() -> None:
    mapping = PodMapping(default_model="base", adapter_annotation="a/loras")
    obj = k8s_pod("p", labels={}, annotations={"a/loras": "x", "extproc.io/adapters": "y"})
    pod = convert(obj, mapping)
    assert pod is not None and pod.adapters == {"x"} and pod.models == {"base", "x"}


def test_a_pod_with_only_adapters_is_warned_about() -> None:
    pod = convert(k8s_pod("p", annotations={"extproc.io/models": "a", "extproc.io/adapters": "a"}))
    assert pod is not None
    (problem,) = pod_warnings(pod, MAPPING)
    assert "no base model: every model is a LoRA adapter (extproc.io/adapters)" in problem
