"""Pods file: data-parallel ranks (``ports``) and LoRA adapters (``adapters``), good and bad."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from extproc.datalayer.pods_file import parse_pods
from extproc.errors import ConfigError
from extproc.pods import RANK_LABEL, Pod, PodId

_DROP = object()


def entry(name: str = "p0", **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": name, "address": "10.0.0.1", "ports": [8000, 8001]}
    base["models"] = ["m"]
    base.update(fields)
    return {k: v for k, v in base.items() if v is not _DROP}


def parse(*entries: dict[str, Any]) -> tuple[Pod, ...]:
    return parse_pods(yaml.safe_dump({"pods": list(entries)}), "f.yaml")


def test_each_port_is_a_rank_of_its_own() -> None:
    rank0, rank1 = parse(entry("dp", namespace="llm", labels={"zone": "b"}))
    assert rank0 == Pod(
        id=PodId("llm", "dp-rank-0"),
        address="10.0.0.1:8000",
        models=frozenset({"m"}),
        labels=((RANK_LABEL, "0"), ("zone", "b")),
    )
    assert (rank1.id, rank1.address) == (PodId("llm", "dp-rank-1"), "10.0.0.1:8001")
    assert rank1.labels == ((RANK_LABEL, "1"), ("zone", "b"))


def test_ranks_follow_the_order_of_ports() -> None:
    pods = parse(entry("dp", ports=[9002, 9000, 9001]))
    assert [(p.id.name, p.address, p.label(RANK_LABEL)) for p in pods] == [
        ("dp-rank-0", "10.0.0.1:9002", "0"),
        ("dp-rank-1", "10.0.0.1:9000", "1"),
        ("dp-rank-2", "10.0.0.1:9001", "2"),
    ]


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"address": "10.0.0.1:8000", "ports": _DROP}, id="address-port"),
        pytest.param({"address": "10.0.0.1", "ports": [8000]}, id="one-port"),
        pytest.param({"address": "10.0.0.1:8000", "ports": [8000]}, id="both-agree"),
    ],
)
def test_one_port_keeps_the_pods_name_and_labels(fields: dict[str, Any]) -> None:
    (pod,) = parse(entry("solo", labels={"a": "b"}, **fields))
    assert (pod.id.name, pod.address, pod.labels) == ("solo", "10.0.0.1:8000", (("a", "b"),))


def test_address_with_the_first_port_and_ports() -> None:
    pods = parse(entry(address="10.0.0.1:8000", ports=[8000, 8001]))
    assert [p.address for p in pods] == ["10.0.0.1:8000", "10.0.0.1:8001"]


def test_ipv6_ranks() -> None:
    pods = parse(entry(address="[fd00::0001]", ports=[1, 2]))
    assert [p.address for p in pods] == ["[fd00::1]:1", "[fd00::1]:2"]


def test_ranks_of_two_pods_on_one_ip() -> None:
    pods = parse(entry("a", ports=[8000, 8001]), entry("b", ports=[8002, 8003]))
    assert [p.id.name for p in pods] == ["a-rank-0", "a-rank-1", "b-rank-0", "b-rank-1"]


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        pytest.param({"ports": []}, "'ports' must be a non-empty list", id="empty"),
        pytest.param({"ports": 8000}, "'ports' must be a non-empty list", id="not-list"),
        pytest.param({"ports": [8000, 0]}, "ports: 0 is not a port number", id="zero"),
        pytest.param({"ports": [65536]}, "ports: 65536 is not a port number", id="too-big"),
        pytest.param({"ports": [-1]}, "ports: -1 is not a port number", id="negative"),
        pytest.param({"ports": ["8000"]}, "ports: '8000' is not a port number", id="string"),
        pytest.param({"ports": [True]}, "ports: True is not a port number", id="bool"),
        pytest.param({"ports": [8000.0]}, "ports: 8000.0 is not a port number", id="float"),
        pytest.param(
            {"ports": [8000, 8001, 8000, 8001]},
            "ports: [8000, 8001] listed more than once",
            id="duplicates",
        ),
        pytest.param(
            {"address": "10.0.0.1:8001", "ports": [8000, 8001]},
            "address '10.0.0.1:8001' has port 8001 but ports[0] (rank 0) is 8000",
            id="address-port-disagrees",
        ),
        pytest.param(
            {"address": "10.0.0.1:9000", "ports": [8000]},
            "has port 9000 but ports[0] (rank 0) is 8000",
            id="address-port-disagrees-one",
        ),
        pytest.param(
            {"address": "fd00::1", "ports": [1]},
            "address 'fd00::1' is neither an IP address (IPv6 as [ip]) nor ip:port",
            id="ipv6-unbracketed",
        ),
        pytest.param(
            {"address": "::1:8000", "ports": [8000]}, "neither an IP", id="ipv6-ambiguous-port"
        ),
        pytest.param({"address": "host", "ports": [1]}, "neither an IP address", id="hostname"),
        pytest.param({"address": "10.0.0.1", "ports": _DROP}, "has no port", id="no-port"),
    ],
)
def test_bad_ports(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=r"^f\.yaml: pods\[0\] 'p0': .*" + re.escape(problem)):
        parse(entry(**fields))


def test_a_rank_on_another_pods_address() -> None:
    solo = {"name": "solo", "address": "10.0.0.1:8001", "models": ["m"]}
    with pytest.raises(
        ConfigError,
        match=r"^f\.yaml: pods\[1\] 'dp': duplicate address '10\.0\.0\.1:8001', "
        r"already used by pods\[0\] 'solo'",
    ):
        parse(solo, entry("dp"))


def test_a_rank_named_as_another_pod() -> None:
    other = {"name": "dp-rank-1", "address": "10.0.0.2:8000", "models": ["m"]}
    with pytest.raises(
        ConfigError, match=r"pods\[1\] 'dp': duplicate name 'default/dp-rank-1'.*pods\[0\]"
    ):
        parse(other, entry("dp"))


def test_adapters_are_models_marked_as_adapters() -> None:
    pod, _ = parse(entry(models=["base"], adapters=["sql-lora", "chat-lora"]))
    assert pod.models == {"base", "sql-lora", "chat-lora"}
    assert pod.adapters == {"sql-lora", "chat-lora"}


def test_an_adapter_also_in_models_is_an_adapter() -> None:
    pod, _ = parse(entry(models=["base", "sql-lora"], adapters=["sql-lora"]))
    assert pod.models == {"base", "sql-lora"} and pod.adapters == {"sql-lora"}


def test_no_adapters() -> None:
    pods = parse(entry(adapters=[]), entry("q", address="10.0.0.2"))
    assert all(p.adapters == frozenset() and p.models == {"m"} for p in pods)


def test_every_rank_serves_the_pods_adapters() -> None:
    pods = parse(entry(models=["base"], adapters=["a"]))
    assert [p.adapters for p in pods] == [frozenset({"a"})] * 2


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        pytest.param({"adapters": "a"}, "'adapters' must be a list", id="string"),
        pytest.param({"adapters": {"a": 1}}, "'adapters' must be a list", id="mapping"),
        pytest.param({"adapters": ["a", 1]}, "entries must be non-empty strings", id="int"),
        pytest.param({"adapters": [" "]}, "entries must be non-empty strings", id="blank"),
        pytest.param(
            {"models": ["m"], "adapters": ["m"]},
            "every model is a LoRA adapter: 'models' must also name the base model",
            id="only-model-is-adapter",
        ),
    ],
)
def test_bad_adapters(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=r"^f\.yaml: pods\[0\] 'p0': .*" + re.escape(problem)):
        parse(entry(**fields))


def test_an_adapter_that_is_another_pods_base_model() -> None:
    base = entry("a", address="10.0.0.1", models=["llama"])
    lora = entry("b", address="10.0.0.2", models=["qwen"], adapters=["llama"])
    with pytest.raises(
        ConfigError,
        match=r"^f\.yaml: pods\[1\] 'b' lists 'llama' as a LoRA adapter, "
        r"but it is a base model of pods\[0\] 'a'",
    ):
        parse(base, lora)
