"""The chart: lint, what each mode renders, Kubernetes' schemas, and the pieces that matter.

Each mode (see conftest.MODES) is linted with ``helm lint --strict`` and rendered offline;
every manifest must pass ``kubernetes-validate --strict`` for Kubernetes 1.33, except the
custom resources, whose schemas it does not have (checked field by field below instead).
"""

from __future__ import annotations

import argparse
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from extproc.cli import serve
from extproc.routing.flow.config import parse_flow_control
from extproc.routing.rewrites import parse_model_rewrites
from extproc.scheduling.config import build_scheduler, default_config_text, parse_config
from testkit.chart import CHART_DIR, GATEWAY_PEERS, MODES, NAMESPACE, find, render

KUBERNETES_VERSION = "1.33"
FULLNAME = "rel-extproc"
CUSTOM_KINDS = {"InferencePool", "HTTPRoute", "ServiceMonitor", "Certificate"}


def kinds(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def picker_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return container  # type: ignore[no-any-return]


def test_lint_strict(mode_values: dict[str, Any]) -> None:
    report = helm_python.lint(CHART_DIR, mode_values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not report["errors"] and not problems, report


def test_manifests_pass_kubernetes_schemas(mode_values: dict[str, Any]) -> None:
    custom = set()
    for doc in render(mode_values):
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            custom.add(doc["kind"])
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc}")
    assert custom <= CUSTOM_KINDS


COMMON = {
    ("ConfigMap", FULLNAME),
    ("Deployment", FULLNAME),
    ("Service", FULLNAME),
    ("ServiceAccount", FULLNAME),
    ("Role", FULLNAME),
    ("RoleBinding", FULLNAME),
    ("PodDisruptionBudget", FULLNAME),
    ("NetworkPolicy", FULLNAME),
    ("Service", f"{FULLNAME}-replicas"),
}
STANDALONE = {
    ("ConfigMap", f"{FULLNAME}-envoy"),
    ("Deployment", f"{FULLNAME}-envoy"),
    ("Service", f"{FULLNAME}-envoy"),
    ("Service", f"{FULLNAME}-model-servers"),
    ("PodDisruptionBudget", f"{FULLNAME}-envoy"),
}


@pytest.mark.parametrize(
    ("mode", "extra"),
    [
        pytest.param("standalone", STANDALONE, id="standalone"),
        pytest.param("external", set(), id="external"),
        pytest.param(
            "gateway", {("InferencePool", FULLNAME), ("HTTPRoute", FULLNAME)}, id="gateway"
        ),
        pytest.param(
            "all-options",
            STANDALONE
            | {("ServiceMonitor", FULLNAME), ("ConfigMap", f"{FULLNAME}-dashboard")}
            | {("Deployment", f"{FULLNAME}-redis"), ("Service", f"{FULLNAME}-redis")},
            id="all-options",
        ),
    ],
)
def test_what_each_mode_renders(mode: str, extra: set[tuple[str, str]]) -> None:
    assert kinds(render(MODES[mode])) == COMMON | extra


def test_picker_pod_runs_hardened_with_grpc_probes() -> None:
    docs = render()
    pod = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    container = picker_container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"] == {"port": 9003}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"ext-proc": 9002, "health": 9003, "metrics": 9090}
    service = find(docs, "Service", FULLNAME)
    assert [p["port"] for p in service["spec"]["ports"]] == [9002, 9003, 9090]
    assert pod["terminationGracePeriodSeconds"] > 10  # the drain (10 s) fits


def _annotations(values: dict[str, Any], deployment: str = FULLNAME) -> dict[str, str]:
    template = find(render(values), "Deployment", deployment)["spec"]["template"]
    return template["metadata"]["annotations"]  # type: ignore[no-any-return]


def _checksum(values: dict[str, Any], deployment: str = FULLNAME) -> str:
    return _annotations(values, deployment)["checksum/config"]


WEIGHTS = {"plugins": {"Score": {"enabled": [{"name": "prefix-cache", "weight": 2}]}}}
NO_RELOAD = {"config": {"reload": False}}


def test_without_live_reload_a_config_change_rolls_the_pods() -> None:
    assert _checksum(NO_RELOAD) == _checksum(NO_RELOAD)
    assert _checksum(NO_RELOAD) != _checksum({**NO_RELOAD, "scheduler": WEIGHTS})
    envoy = f"{FULLNAME}-envoy"
    assert _checksum({}, envoy) != _checksum({"envoy": {"failureModeAllow": True}}, envoy)
    assert "--config-poll-s=0" in picker_container(render(NO_RELOAD))["args"]


def test_with_live_reload_only_a_flow_control_change_rolls_the_pods() -> None:
    """The default: the scheduler section is applied live from the mounted ConfigMap (a
    whole-volume mount, which the kubelet updates; a subPath mount never is), so its
    change leaves the pod template alone; flowControl needs a restart, so it rolls."""
    assert _annotations({}) == _annotations({"scheduler": WEIGHTS})
    assert "checksum/config" not in _annotations({})
    flow = _annotations({"flowControl": {"queue": {"ttlS": 30}}})
    assert flow["checksum/flow-control"] != _annotations({})["checksum/flow-control"]
    (mount,) = [m for m in picker_container(render())["volumeMounts"] if m["name"] == "config"]
    assert mount["mountPath"] == "/etc/extproc" and "subPath" not in mount
    args = picker_container(render())["args"]
    assert "--config=/etc/extproc/config.yaml" in args
    assert not any(a.startswith("--config-poll-s") for a in args)  # serve's default: 2 s


@pytest.mark.parametrize(
    ("mode", "source_args", "pool_rule"),
    [
        pytest.param(
            "standalone", ["--k8s-selector=app=vllm", "--k8s-target-port=8000"], False, id="pods"
        ),
        pytest.param("gateway", [f"--inference-pool={FULLNAME}"], True, id="pool"),
    ],
)
def test_discovery_args_and_least_rbac(mode: str, source_args: list[str], pool_rule: bool) -> None:
    docs = render(MODES[mode])
    args = picker_container(docs)["args"]
    assert f"--k8s-namespace={NAMESPACE}" in args
    assert all(a in args for a in source_args)
    assert ("--k8s-selector=app=vllm" in args) is not pool_rule
    rules = find(docs, "Role")["rules"]
    expected = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    if pool_rule:
        expected.append(
            {
                "apiGroups": ["inference.networking.k8s.io"],
                "resources": ["inferencepools"],
                "verbs": ["list", "watch"],
                "resourceNames": [FULLNAME],  # the pool is named after the release
            }
        )
        expected += [  # flow control's InferenceObjective priorities, and model rewrites
            {
                "apiGroups": ["inference.networking.x-k8s.io"],
                "resources": [resource],
                "verbs": ["list", "watch"],
            }
            for resource in ("inferenceobjectives", "inferencemodelrewrites")
        ]
    assert rules == expected
    binding = find(docs, "RoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}
    ]


def test_picker_args_are_extproc_serve_flags(mode_values: dict[str, Any]) -> None:
    container = picker_container(render(mode_values))
    assert container["command"] == ["extproc"] and container["args"][0] == "serve"
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    _, unknown = parser.parse_known_args(container["args"])
    assert not unknown, f"not extproc serve flags: {unknown}"


def test_optional_discovery_flags_reach_the_args() -> None:
    args = picker_container(render(MODES["all-options"]))["args"]
    assert "--k8s-model-label=llm/model" in args and "--k8s-role-label=llm/role" in args
    assert args[-2:] == ["--k8s-default-model", "qwen3"]


@pytest.mark.parametrize(
    ("redis", "url"),
    [
        pytest.param({}, None, id="no-sharing"),
        pytest.param({"deploy": True}, f"redis://{FULLNAME}-redis:6379/0", id="chart-redis"),
        pytest.param(
            {"url": "redis://r.infra:6379/1", "deploy": True}, "redis://r.infra:6379/1", id="url"
        ),
    ],
)
def test_replicas_share_through_the_redis_the_values_name(
    redis: dict[str, Any], url: str | None
) -> None:
    docs = render({"replicas": 2, "redis": redis})
    args = picker_container(docs)["args"]
    assert "--record-metadata=on" in args
    sharing = [a for a in args if a.startswith("--redis-url=")]
    assert sharing == ([f"--redis-url={url}"] if url else [])
    runs_redis = ("Deployment", f"{FULLNAME}-redis") in kinds(docs)
    assert runs_redis is (url == f"redis://{FULLNAME}-redis:6379/0")


@pytest.mark.parametrize(
    ("mode", "peers"),
    [
        pytest.param(
            "standalone",
            [
                {
                    "podSelector": {
                        "matchLabels": {
                            "app.kubernetes.io/name": "extproc",
                            "app.kubernetes.io/instance": "rel",
                            "app.kubernetes.io/component": "envoy",
                        }
                    }
                }
            ],
            id="standalone-envoy",
        ),
        pytest.param("external", GATEWAY_PEERS, id="external-gateway"),
        pytest.param("gateway", GATEWAY_PEERS, id="gateway-inference-pool"),
    ],
)
def test_network_policy_admits_only_the_gateway_to_ext_proc(
    mode: str, peers: list[dict[str, Any]]
) -> None:
    docs = render(MODES[mode])
    policy = find(docs, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "picker"
    assert policy["policyTypes"] == ["Ingress"]
    # every rule names its ports (a rule without ports admits every port) ...
    assert all(r.get("ports") for r in policy["ingress"])
    assert {p["port"] for r in policy["ingress"] for p in r["ports"]} == {9002, 9003, 9090}
    # ... and the one naming 9002 names nothing else and admits only the gateway
    [ext_proc_rule] = [r for r in policy["ingress"] if any(p["port"] == 9002 for p in r["ports"])]
    assert ext_proc_rule["ports"] == [{"port": 9002, "protocol": "TCP"}]
    assert ext_proc_rule["from"] == peers
    # the policy's selector is the picker's pods, whose ext_proc port it names
    deployment = find(docs, "Deployment", FULLNAME)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--grpc-port=9002" in container["args"]
    assert {p["containerPort"] for p in container["ports"]} == {9002, 9003, 9090}


@pytest.mark.parametrize(
    "arg", ["--grpc-port=9999", "--address=10.0.0.1", "--metrics-port", "--health-port=1"]
)
def test_extra_args_cannot_move_the_ports_the_policy_guards(arg: str) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        render({"picker": {"extraArgs": [arg]}})


def test_inference_pool_picks_with_extproc() -> None:
    docs = render(MODES["gateway"])
    pool = find(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"] == {
        "selector": {"matchLabels": {"app": "vllm"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {
            "kind": "Service",
            "name": FULLNAME,
            "port": {"number": 9002},
            "failureMode": "FailClose",
        },
    }
    assert find(docs, "Service", FULLNAME)["spec"]["ports"][0]["port"] == 9002
    route = find(docs, "HTTPRoute")["spec"]
    assert route["parentRefs"] == [{"name": "gw"}]
    assert route["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": FULLNAME}
    ]


def test_service_monitor_scrapes_the_metrics_port() -> None:
    docs = render(MODES["all-options"])
    monitor = find(docs, "ServiceMonitor")["spec"]
    service = find(docs, "Service", FULLNAME)
    assert monitor["endpoints"][0]["port"] == "http-metrics"
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


def test_configmap_config_is_extprocs_default_and_loads() -> None:
    """The shipped ConfigMap is extproc's embedded default, and its loader builds it."""
    text = find(render(), "ConfigMap", FULLNAME)["data"]["config.yaml"]
    assert yaml.safe_load(text) == yaml.safe_load(default_config_text())
    config = parse_config(text, "chart ConfigMap")
    build_scheduler(config, CollectorRegistry())
    assert [(s.name, s.weight) for s in config.scores] == [
        ("estimated-ttft", 1),
        ("lora-affinity", 6),
    ]
    assert config.filters == ()


def test_dashboard_configmap_holds_the_dashboard_json() -> None:
    configmap = find(render(MODES["all-options"]), "ConfigMap", f"{FULLNAME}-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (CHART_DIR / "dashboards" / "extproc.json").read_text()
    assert configmap["data"]["extproc.json"].strip() == shipped.strip()


def test_the_flow_control_value_becomes_the_configs_section() -> None:
    """flowControl ({} by default, as config.yaml ships it; null: off) is rendered as the
    configuration's top-level section, which extproc parses as it would its own file."""
    configmap = find(render({"flowControl": {"queue": {"ttlS": 30}}}), "ConfigMap", FULLNAME)
    text = configmap["data"]["config.yaml"]
    config = parse_config(text, "chart")
    flow = parse_flow_control(config.flow_control, config.source)
    assert flow.enabled and flow.ttl_s == 30


def test_the_model_rewrites_value_becomes_the_configs_section() -> None:
    """modelRewrites ([] by default: no section) is rendered as the configuration's
    top-level section, which extproc parses as it would its own file."""
    assert "modelRewrites" not in yaml.safe_load(
        find(render(), "ConfigMap", FULLNAME)["data"]["config.yaml"]
    )
    rules = [
        {
            "matches": [{"model": "food-review"}],
            "targets": [
                {"modelRewrite": "food-review-v2", "weight": 90},
                {"modelRewrite": "food-review-v1", "weight": 10},
            ],
        }
    ]
    configmap = find(render({"modelRewrites": rules}), "ConfigMap", FULLNAME)
    config = parse_config(configmap["data"]["config.yaml"], "chart")
    (rule,) = parse_model_rewrites(config.model_rewrites, config.source)
    assert [(t.model, t.weight) for t in rule.targets] == [
        ("food-review-v2", 90),
        ("food-review-v1", 10),
    ]


def test_extra_target_ports_are_the_pools_data_parallel_ranks() -> None:
    values = {**MODES["gateway"], "modelServers": {"extraTargetPorts": [8001, 8002]}}
    pool = find(render(values), "InferencePool")
    assert pool["spec"]["targetPorts"] == [{"number": n} for n in (8000, 8001, 8002)]
