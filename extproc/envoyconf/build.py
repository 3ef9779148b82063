"""Envoy configuration for extproc, built from the data-plane API's protobuf classes
(from ``EnvoyOptions``, checked in ``envoyconf.options``).

The classes come from ``xds-protos`` (the gRPC project's generated Envoy API), which the
server needs anyway: no extra dependency, field names and types are checked as the
objects are built, and ``json_format.MessageToDict`` writes ``typed_config`` Any fields
with their ``@type``. (envoy-data-plane's dataclasses would do too, but would be one more
dependency, and are much slower to build and parse.)

One ext_proc round per request (measured cheapest, envoy/README.md): Envoy skips the
request headers, sends the whole body, and ``envoy.filters.http.buffer`` between
ext_proc and the router holds routing until the body reply, whose dynamic metadata
``envoy.lb/x-gateway-destination-endpoint`` ("ip:port,ip:port", best first) drives the
``override_host`` load balancer; the route retries down that list. The gRPC access log
service, on the same extproc cluster, reports how each request ended.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
    extension_pb2,
    grpc_service_pb2,
    protocol_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.config.trace.v3 import http_tracer_pb2, opentelemetry_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2 as tls_common_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.matcher.v3 import metadata_pb2 as metadata_matcher_pb2
from envoy.type.matcher.v3 import string_pb2 as string_matcher_pb2
from envoy.type.matcher.v3 import value_pb2
from envoy.type.metadata.v3 import metadata_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2, duration_pb2, message, wrappers_pb2

from extproc.envoyconf.options import EnvoyOptions, split_host_port
from extproc.pods import Pod
from extproc.wire.protocol import (
    ACCESS_LOG_NAME,
    DESTINATION_KEY,
    DESTINATION_NAMESPACE,
    INTERNAL_HEADERS,
    MAX_RETRIES_HEADER,
    PATH_ATTRIBUTE,
    PREFILL_HEADER,
    RECORD_NAMESPACE,
    REQUEST_ID_ATTRIBUTE,
    SUBSET_HINT_NAMESPACE,
    header_attribute,
)

PODS_CLUSTER = "extproc_pods"
EXTPROC_CLUSTER = "extproc"
OTLP_CLUSTER = "otlp_collector"
ENVOY_SERVICE_NAME = "envoy"  # service.name on Envoy's spans
# An export that takes longer is dropped: spans must never hold Envoy's workers.
OTLP_EXPORT_TIMEOUT_S = 1.0


RETRY_ON = "5xx,reset,connect-failure,refused-stream"
# Envoy's default circuit breakers allow 1024 requests and 3 concurrent retries per
# cluster: under a burst of long generations that turns into local 503s and skipped
# fail-overs. The pods queue requests themselves, so Envoy should not cap them.
CIRCUIT_BREAKER_LIMIT = 1 << 20
# Each try goes to a different pod, so there is nothing to back off from; Envoy wants
# some interval, and one this short keeps a fail-over well under a token's time.
RETRY_BACK_OFF_BASE_S = 0.005
RETRY_BACK_OFF_MAX_S = 0.05
# A request gets one retry per pod listed after the first (x-envoy-max-retries), so the
# list is never exhausted; were it (a listed pod missing from the cluster), the
# round-robin fallback may pick a pod that already failed: previous_hosts rejects it
# and Envoy picks again, at most this many times.
HOST_SELECTION_RETRY_MAX_ATTEMPTS = 5
# The access log's entries go out in batches: at this size or this age, whichever first.
ACCESS_LOG_BUFFER_BYTES = 16384
ACCESS_LOG_FLUSH_MS = 10


@dataclass(frozen=True, slots=True)
class Snippet:
    """What an existing Envoy needs to route through extproc."""

    http_filters: list[hcm_pb2.HttpFilter]  # before the router, in this order
    access_log: accesslog_pb2.AccessLog  # on the HttpConnectionManager
    clusters: list[cluster_pb2.Cluster]  # extproc, and the pods
    route_action: route_components_pb2.RouteAction  # cluster, timeout, retry policy
    request_headers_to_remove: list[str]  # on the virtual host
    # on the same virtual host (one header parser removes before it adds, so the
    # client's copy is dropped and ours added): the prefill pod extproc chose
    request_headers_to_add: list[base_pb2.HeaderValueOption]
    per_connection_buffer_limit_bytes: int  # on the listener
    # on the HttpConnectionManager, with ``options.otlp_endpoint`` (its cluster is in
    # ``clusters``): Envoy's OpenTelemetry tracing, whose context extproc's span continues
    tracing: hcm_pb2.HttpConnectionManager.Tracing | None = None


def make_bootstrap(pods: Sequence[Pod], options: EnvoyOptions) -> bootstrap_pb2.Bootstrap:
    """A standalone Envoy: one listener routing every request to the pods via extproc."""
    snippet = make_snippet(pods, options)
    route_config = route_pb2.RouteConfiguration(
        name="llm_routes",
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name="llm",
                domains=["*"],
                routes=[
                    route_components_pb2.Route(
                        match=route_components_pb2.RouteMatch(prefix="/"),
                        route=snippet.route_action,
                    )
                ],
                request_headers_to_remove=snippet.request_headers_to_remove,
                request_headers_to_add=snippet.request_headers_to_add,
            )
        ],
    )
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix="llm",
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        route_config=route_config,
        http_filters=[
            *snippet.http_filters,
            _filter("envoy.filters.http.router", router_pb2.Router()),
        ],
        access_log=[snippet.access_log],
        # Envoy makes the x-request-id that ext_proc and the access log share; a
        # client's own id is replaced (edge request, preserve_external_request_id off).
        generate_request_id=wrappers_pb2.BoolValue(value=True),
        use_remote_address=wrappers_pb2.BoolValue(value=True),
        tracing=snippet.tracing,
    )
    listener = listener_pb2.Listener(
        name="llm",
        address=_socket_address(options.listen_address, options.listen_port),
        per_connection_buffer_limit_bytes=wrappers_pb2.UInt32Value(
            value=snippet.per_connection_buffer_limit_bytes
        ),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[
                    listener_components_pb2.Filter(
                        name="envoy.filters.network.http_connection_manager",
                        typed_config=_any(manager),
                    )
                ]
            )
        ],
    )
    return bootstrap_pb2.Bootstrap(
        node=base_pb2.Node(id="extproc-envoy", cluster="extproc"),
        admin=bootstrap_pb2.Admin(address=_socket_address("127.0.0.1", options.admin_port)),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(
            listeners=[listener], clusters=snippet.clusters
        ),
    )


def make_snippet(pods: Sequence[Pod], options: EnvoyOptions) -> Snippet:
    """The filters, access log, clusters and route settings, for an existing Envoy."""
    return Snippet(
        http_filters=[
            _filter("envoy.filters.http.ext_proc", make_ext_proc(options)),
            # Holds the request (headers included) until the whole body has passed
            # ext_proc, so the router picks a host after the body reply's metadata.
            _filter(
                "envoy.filters.http.buffer",
                buffer_pb2.Buffer(
                    max_request_bytes=wrappers_pb2.UInt32Value(value=options.max_body_bytes)
                ),
            ),
        ],
        access_log=make_access_log(),
        clusters=[
            make_extproc_cluster(options),
            make_pods_cluster(pods, options),
            *([make_otlp_cluster(options.otlp_endpoint)] if options.otlp_endpoint else []),
        ],
        route_action=make_route_action(options),
        request_headers_to_remove=[*INTERNAL_HEADERS, MAX_RETRIES_HEADER],
        request_headers_to_add=[make_prefill_header(), make_max_retries_header()],
        per_connection_buffer_limit_bytes=options.max_body_bytes,
        tracing=make_tracing(options.trace_sampling) if options.otlp_endpoint else None,
    )


def make_tracing(sampling: float) -> hcm_pb2.HttpConnectionManager.Tracing:
    """Envoy's OpenTelemetry tracer, exporting to the OTLP cluster, tracing ``sampling``
    of the requests. Envoy's async gRPC client puts the ext_proc call's span context
    (``traceparent``) in the stream's metadata: extproc's span continues the trace."""
    config = opentelemetry_pb2.OpenTelemetryConfig(
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=OTLP_CLUSTER),
            timeout=_duration(OTLP_EXPORT_TIMEOUT_S),
        ),
        service_name=ENVOY_SERVICE_NAME,
    )
    return hcm_pb2.HttpConnectionManager.Tracing(
        random_sampling=percent_pb2.Percent(value=sampling * 100),
        provider=http_tracer_pb2.Tracing.Http(
            name="envoy.tracers.opentelemetry", typed_config=_any(config)
        ),
    )


def make_otlp_cluster(endpoint: str) -> cluster_pb2.Cluster:
    """The OpenTelemetry collector's OTLP gRPC port (HTTP/2), by IP or DNS name."""
    host, port, is_ip = split_host_port(endpoint)
    return cluster_pb2.Cluster(
        name=OTLP_CLUSTER,
        type=cluster_pb2.Cluster.STATIC if is_ip else cluster_pb2.Cluster.STRICT_DNS,
        connect_timeout=_duration(1.0),
        typed_extension_protocol_options=_http2_options(),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=OTLP_CLUSTER,
            endpoints=[
                endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[_lb_endpoint(host, port)])
            ],
        ),
    )


def make_prefill_header() -> base_pb2.HeaderValueOption:
    """``x-prefiller-host-port`` from the reply's metadata; not added when it is empty."""
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(
            key=PREFILL_HEADER,
            value=f"%DYNAMIC_METADATA({DESTINATION_NAMESPACE}:{PREFILL_HEADER})%",
        ),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        keep_empty_value=False,
    )


def make_max_retries_header() -> base_pb2.HeaderValueOption:
    """``x-envoy-max-retries``: the fallbacks extproc listed (one retry each), from the
    reply's metadata; not added without a list (failing open: the route's num_retries)."""
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(
            key=MAX_RETRIES_HEADER,
            value=f"%DYNAMIC_METADATA({DESTINATION_NAMESPACE}:{MAX_RETRIES_HEADER})%",
        ),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        keep_empty_value=False,
    )


def make_ext_proc(options: EnvoyOptions) -> ext_proc_pb2.ExternalProcessor:
    """ext_proc: one round per request (the buffered body), replies may set envoy.lb."""
    mode = processing_mode_pb2.ProcessingMode
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=_grpc_service(),
        failure_mode_allow=options.failure_mode_allow,
        processing_mode=mode(
            request_header_mode=mode.SKIP,
            request_body_mode=mode.BUFFERED,
            request_trailer_mode=mode.SKIP,
            response_header_mode=mode.SKIP,
            response_body_mode=mode.NONE,
            response_trailer_mode=mode.SKIP,
        ),
        request_attributes=[
            PATH_ATTRIBUTE,
            REQUEST_ID_ATTRIBUTE,
            *map(header_attribute, options.attribute_headers),
        ],
        message_timeout=_duration(options.message_timeout_s),
        max_message_timeout=_duration(options.max_message_timeout_s),
        metadata_options=ext_proc_pb2.MetadataOptions(
            forwarding_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(
                untyped=[SUBSET_HINT_NAMESPACE]
            ),
            # Without this the reply's metadata is silently dropped: envoy.lb routes,
            # extproc.record comes back in the access log (any replica can record).
            receiving_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(
                untyped=[DESTINATION_NAMESPACE, RECORD_NAMESPACE]
            ),
        ),
    )


def make_access_log() -> accesslog_pb2.AccessLog:
    """One gRPC access-log entry per routed request, sent as soon as the request ends.

    Only requests whose dynamic metadata holds the destination list are logged: the
    rest (ImmediateResponses, fail-open requests) have nothing for extproc to learn.
    """
    return accesslog_pb2.AccessLog(
        name="envoy.access_loggers.http_grpc",
        filter=accesslog_pb2.AccessLogFilter(
            metadata_filter=accesslog_pb2.MetadataFilter(
                matcher=metadata_matcher_pb2.MetadataMatcher(
                    filter=DESTINATION_NAMESPACE,
                    path=[metadata_matcher_pb2.MetadataMatcher.PathSegment(key=DESTINATION_KEY)],
                    value=value_pb2.ValueMatcher(present_match=True),
                ),
                match_if_key_not_found=wrappers_pb2.BoolValue(value=False),
            )
        ),
        typed_config=_any(
            als_pb2.HttpGrpcAccessLogConfig(
                common_config=als_pb2.CommonGrpcAccessLogConfig(
                    log_name=ACCESS_LOG_NAME,
                    grpc_service=_grpc_service(),
                    transport_api_version=config_source_pb2.ApiVersion.V3,
                    # Batched: less CPU per request than a message an entry (measured:
                    # envoy/README.md), for at most ACCESS_LOG_FLUSH_MS more before a record.
                    buffer_size_bytes=wrappers_pb2.UInt32Value(value=ACCESS_LOG_BUFFER_BYTES),
                    buffer_flush_interval=duration_pb2.Duration(
                        nanos=ACCESS_LOG_FLUSH_MS * 1_000_000
                    ),
                )
            )
        ),
    )


def make_route_action(options: EnvoyOptions) -> route_components_pb2.RouteAction:
    """Route to the pods; each retry takes the next pod of extproc's list."""
    retry = route_components_pb2.RetryPolicy
    return route_components_pb2.RouteAction(
        cluster=PODS_CLUSTER,
        # No overall deadline: generations run for minutes. The connection manager's
        # stream idle timeout (5 min by default) still ends stalled streams.
        timeout=_duration(0),
        retry_policy=retry(
            retry_on=RETRY_ON,
            num_retries=wrappers_pb2.UInt32Value(value=options.num_fallbacks),
            retry_host_predicate=[
                retry.RetryHostPredicate(
                    name="envoy.retry_host_predicates.previous_hosts",
                    typed_config=_any(previous_hosts_pb2.PreviousHostsPredicate()),
                )
            ],
            host_selection_retry_max_attempts=HOST_SELECTION_RETRY_MAX_ATTEMPTS,
            retry_back_off=retry.RetryBackOff(
                base_interval=_duration(RETRY_BACK_OFF_BASE_S),
                max_interval=_duration(RETRY_BACK_OFF_MAX_S),
            ),
        ),
    )


def make_pods_cluster(pods: Sequence[Pod], options: EnvoyOptions) -> cluster_pb2.Cluster:
    """The pods, load-balanced by extproc's metadata (only).

    Static endpoints from ``pods``, or with ``options.pods_dns`` every address its name
    resolves to (refreshed every 5 s): override_host can only pick cluster members, and
    a Kubernetes headless Service resolves to exactly the ready pods' IPs.
    """
    source = override_host_pb2.OverrideHost.OverrideHostSource
    override_host = override_host_pb2.OverrideHost(
        # Metadata only: a header source would obey a client-sent header.
        override_host_sources=[
            source(
                metadata=metadata_pb2.MetadataKey(
                    key=DESTINATION_NAMESPACE,
                    path=[metadata_pb2.MetadataKey.PathSegment(key=DESTINATION_KEY)],
                )
            )
        ],
        # Used when the list is missing (fail-open) or exhausted by retries.
        fallback_policy=_lb_policy(
            "envoy.load_balancing_policies.round_robin", round_robin_pb2.RoundRobin()
        ),
    )
    cluster = cluster_pb2.Cluster(
        name=PODS_CLUSTER,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=_duration(options.connect_timeout_s),
        load_balancing_policy=_lb_policy(
            "envoy.load_balancing_policies.override_host", override_host
        ),
        circuit_breakers=_open_circuit_breakers(),
    )
    if options.pods_dns is None:
        endpoints = [_lb_endpoint(*split_host_port(pod.address)[:2]) for pod in pods]
    else:
        cluster.type = cluster_pb2.Cluster.STRICT_DNS
        # extproc lists a pod by its primary IP (status.podIP, IPv4 in dual-stack
        # clusters); the resolved hosts must carry the same address to be picked.
        cluster.dns_lookup_family = cluster_pb2.Cluster.V4_PREFERRED
        endpoints = [_lb_endpoint(*split_host_port(options.pods_dns)[:2])]
    cluster.load_assignment.CopyFrom(
        endpoint_pb2.ClusterLoadAssignment(
            cluster_name=PODS_CLUSTER,
            endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=endpoints)],
        )
    )
    return cluster


def make_extproc_cluster(options: EnvoyOptions) -> cluster_pb2.Cluster:
    """extproc's gRPC server over HTTP/2 (ext_proc streams and access-log streams)."""
    addresses = options.extproc_addresses
    all_ips = all(is_ip for _, _, is_ip in addresses)
    cluster = cluster_pb2.Cluster(
        name=EXTPROC_CLUSTER,
        type=cluster_pb2.Cluster.STATIC if all_ips else cluster_pb2.Cluster.STRICT_DNS,
        connect_timeout=_duration(options.connect_timeout_s),
        typed_extension_protocol_options=_http2_options(),
        circuit_breakers=_open_circuit_breakers(),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=EXTPROC_CLUSTER,
            endpoints=[
                endpoint_components_pb2.LocalityLbEndpoints(
                    lb_endpoints=[_lb_endpoint(host, port) for host, port, _ in addresses]
                )
            ],
        ),
        # With several replicas the SNI defaults to the first one's host (set extproc_sni).
        transport_socket=make_extproc_tls(options, addresses[0][0])
        if options.extproc_tls
        else None,
    )
    if len(addresses) > 1 or not all_ips:
        # Several replicas (listed, or behind a DNS name): one that refuses connections
        # (killed, restarting) is marked unhealthy by a TCP check every 0.5 s, and ejected
        # at its first refused stream meanwhile, so the next streams go to the others.
        check = cluster.health_checks.add()
        check.tcp_health_check.SetInParent()
        check.interval.FromMilliseconds(500)
        check.timeout.FromMilliseconds(500)
        check.unhealthy_threshold.value = 1
        check.healthy_threshold.value = 1
        check.no_traffic_interval.FromMilliseconds(500)
        cluster.outlier_detection.split_external_local_origin_errors = True
        cluster.outlier_detection.consecutive_local_origin_failure.value = 1
        cluster.outlier_detection.enforcing_consecutive_local_origin_failure.value = 100
        cluster.outlier_detection.interval.FromMilliseconds(500)
        cluster.outlier_detection.base_ejection_time.FromMilliseconds(1000)
        cluster.outlier_detection.max_ejection_percent.value = 50
    return cluster


def make_extproc_tls(options: EnvoyOptions, host: str) -> base_pb2.TransportSocket:
    """TLS towards extproc: ALPN h2 (gRPC), SNI, extproc's CA when it verifies, and its
    own certificate for mTLS."""
    common = tls_pb2.CommonTlsContext(alpn_protocols=["h2"])
    sni = options.extproc_sni or host
    if options.extproc_ca_file:
        validation = common.validation_context
        validation.trusted_ca.filename = options.extproc_ca_file
        validation.match_typed_subject_alt_names.append(
            tls_common_pb2.SubjectAltNameMatcher(
                san_type=tls_common_pb2.SubjectAltNameMatcher.IP_ADDRESS
                if _is_ip(sni)
                else tls_common_pb2.SubjectAltNameMatcher.DNS,
                matcher=string_matcher_pb2.StringMatcher(exact=sni),
            )
        )
    if options.extproc_client_cert_file and options.extproc_client_key_file:
        common.tls_certificates.append(
            tls_common_pb2.TlsCertificate(
                certificate_chain=base_pb2.DataSource(filename=options.extproc_client_cert_file),
                private_key=base_pb2.DataSource(filename=options.extproc_client_key_file),
            )
        )
    context = tls_pb2.UpstreamTlsContext(common_tls_context=common, sni="" if _is_ip(sni) else sni)
    return base_pb2.TransportSocket(name="envoy.transport_sockets.tls", typed_config=_any(context))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _grpc_service() -> grpc_service_pb2.GrpcService:
    return grpc_service_pb2.GrpcService(
        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=EXTPROC_CLUSTER)
    )


def _http2_options() -> dict[str, any_pb2.Any]:
    """A cluster's protocol options for gRPC: HTTP/2."""
    http2 = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
        )
    )
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _any(http2)}


def _open_circuit_breakers() -> circuit_breaker_pb2.CircuitBreakers:
    limit = wrappers_pb2.UInt32Value(value=CIRCUIT_BREAKER_LIMIT)
    return circuit_breaker_pb2.CircuitBreakers(
        thresholds=[
            circuit_breaker_pb2.CircuitBreakers.Thresholds(
                max_connections=limit,
                max_pending_requests=limit,
                max_requests=limit,
                max_retries=limit,
            )
        ]
    )


def _lb_endpoint(host: str, port: int) -> endpoint_components_pb2.LbEndpoint:
    return endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(address=_socket_address(host, port))
    )


def _socket_address(ip: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(address=ip, port_value=port)
    )


def _filter(name: str, config: message.Message) -> hcm_pb2.HttpFilter:
    return hcm_pb2.HttpFilter(name=name, typed_config=_any(config))


def _lb_policy(name: str, config: message.Message) -> cluster_pb2.LoadBalancingPolicy:
    return cluster_pb2.LoadBalancingPolicy(
        policies=[
            cluster_pb2.LoadBalancingPolicy.Policy(
                typed_extension_config=extension_pb2.TypedExtensionConfig(
                    name=name, typed_config=_any(config)
                )
            )
        ]
    )


def _any(config: message.Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(config)
    return packed


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration
