"""The picker's wiring: configuration -> scheduler; pods source and each pod's scraped
/metrics -> pod store -> router; gRPC ext_proc + access log on ``--grpc-port``, gRPC
health on ``--health-port``, Prometheus metrics on ``--metrics-port``; and the drain.

``start`` builds everything from parsed ``serve`` flags (``cli.serve``) by construction,
with ``--redis-url`` the sharing of the view with the other replicas (``routing.sharing``);
``Running.stop`` drains: health goes NOT_SERVING, new ext_proc streams are refused, the
requests being prepared are routed, and the requests in flight are recorded until none
is pending or the drain time has passed.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import grpc
from grpc_health.v1 import health
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from extproc.admin.pick_log import PickLog
from extproc.admin.reload import ConfigReloader
from extproc.admin.server import AdminServer, start_admin
from extproc.admin.status_page import add_status_page
from extproc.admin.tracing import Tracing, check_tracing_args, start_tracing
from extproc.datalayer.kv_events import KvEventsSubscriber, settings_from_args
from extproc.datalayer.model_rewrites import (
    ModelRewriteWatcher,
    WatchedRewrite,
    make_rewrites_watcher,
)
from extproc.datalayer.objectives import InferenceObjectiveWatcher
from extproc.datalayer.scrape import MetricsScraper, ScrapeOptions
from extproc.datalayer.scrape_process import ScrapeProcess
from extproc.datalayer.sources import (
    PodsSource,
    check_pods_source,
    describe_source,
    make_objectives_watcher,
    make_pods_source,
)
from extproc.datalayer.store import PodStore
from extproc.envoyconf.options import DEFAULT_MAX_MESSAGE_TIMEOUT_S
from extproc.errors import ConfigError
from extproc.kernels import IMPLEMENTATION as KERNELS_IMPLEMENTATION
from extproc.pods import Pod
from extproc.prefix.snapshot import PreciseView, View, ViewSnapshot
from extproc.request.render import Rendering
from extproc.routing.flow.config import FlowConfig, parse_flow_control
from extproc.routing.outcome_metrics import OutcomeMetrics
from extproc.routing.preparing import PreparePool
from extproc.routing.rewrites import WatchedRules, check_targets, parse_model_rewrites
from extproc.routing.router import Router
from extproc.routing.sharing import RedisSharing
from extproc.scheduling.config import build_scheduler, config_text, parse_config, plugins_of
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.scheduling.plugins.prefix_cache import PrefixCacheScorer
from extproc.scheduling.scheduler import Scheduler
from extproc.scheduling.sessions import SessionStore
from extproc.wire.epp import epp_process
from extproc.wire.ext_proc import HOLD_MARGIN_S
from extproc.wire.protocol import ACCESS_LOG_PATH
from extproc.wire.server import (
    GRPC_MESSAGE_HEADROOM_BYTES,
    GrpcServer,
    make_grpc_server,
    make_health_server,
    set_serving,
)
from extproc.wire.tls import TlsSettings, server_credentials

log = logging.getLogger("extproc.serve")

STOP_GRACE_S = 2.0  # beyond --drain-s, for the servers to confirm they stopped
RESTORED_MODEL = "(view snapshot)"  # the model label of restored entries' evictions


@dataclass
class Running:
    """A started picker; ``stop()`` drains and shuts everything down."""

    router: Router
    grpc_server: GrpcServer
    grpc_port: int
    health_server: grpc.Server
    health_servicer: health.HealthServicer
    health_port: int
    watcher: PodsSource
    scraper: MetricsScraper | ScrapeProcess | None
    metrics_server: Any
    registry: CollectorRegistry
    sharing: RedisSharing | None = None
    kv_events: KvEventsSubscriber | None = None
    objectives: InferenceObjectiveWatcher | None = None
    rewrites: ModelRewriteWatcher | None = None
    tracing: Tracing | None = None
    reloader: ConfigReloader | None = None
    admin: AdminServer | None = None
    snapshot: ViewSnapshot | None = None

    def stop(self, drain_s: float = 10.0) -> None:
        set_serving(self.health_servicer, False)
        # New ext_proc streams are refused (Envoy answers 500 or fails open); the access
        # logs of the requests in flight still come in and are recorded, until none is
        # pending or drain_s has passed. First of all: stopping the feeds below takes
        # time (the scraper's child process exits), while streams end and are recorded.
        self.grpc_server.drain(keep=[ACCESS_LOG_PATH])
        deadline = time.monotonic() + drain_s
        # Requests waiting for their preparation are routed without it now (approximate),
        # those being prepared are waited for, so that every stream gets its route while
        # the server still sends.
        if not self.router.close(drain_s):
            log.warning("requests still being prepared after %.1f s", drain_s)
        in_flight, recorded = len(self.router.pending), self._recorded()
        log.info("draining: new ext_proc streams are refused; %d routed in flight", in_flight)
        self._stop_feeds()
        while len(self.router.pending) and time.monotonic() < deadline:
            time.sleep(0.05)
        log.info(
            "drained: %d routed requests were in flight, %d recorded since, %d left pending",
            in_flight,
            self._recorded() - recorded,
            len(self.router.pending),
        )
        # Bounded: the stop must end even if a stream ignores the cancellation.
        if not self.grpc_server.stop(0).wait(STOP_GRACE_S):
            log.warning("the gRPC server did not confirm its stop; exiting anyway")
        self.health_server.stop(0).wait(STOP_GRACE_S)
        if self.sharing is not None:
            self.sharing.stop()
        if self.snapshot is not None:  # nothing records any more, no event comes in
            scheduler = self.router.scheduler
            self.snapshot.write(snapshot_views(scheduler), precise_views(scheduler, self.kv_events))
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        if self.tracing is not None:
            self.tracing.stop()  # exports the spans still batched
        if self.admin is not None:
            self.admin.stop()

    def _stop_feeds(self) -> None:
        """What brings in pods, metrics, events and configuration: nothing is routed now."""
        if self.reloader is not None:
            self.reloader.stop()
        self.watcher.stop()
        if self.objectives is not None:
            self.objectives.stop()
        if self.rewrites is not None:
            self.rewrites.stop()
        if self.kv_events is not None:
            self.kv_events.stop()
        if self.scraper is not None:
            self.scraper.stop()

    def _recorded(self) -> int:
        value = self.registry.get_sample_value("extproc_completions_total", {"outcome": "recorded"})
        return int(value or 0)


_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag values that cannot work, naming the flag (argparse checks only types).

    Raises:
        ConfigError: the first bad value (a missing or doubled pods source first).
    """
    check_pods_source(args)
    for flag in ("grpc_port", "health_port", "metrics_port"):
        port = getattr(args, flag)
        if not 0 <= port <= 65535:  # grpcio would wrap 99999 to 34463 and serve there
            raise ConfigError(
                f"--{flag.replace('_', '-')} must be a port number from 0 to 65535, got {port}"
            )
    rules = (
        ("num_fallbacks", args.num_fallbacks >= 0, "must be 0 or more"),
        ("max_streams", args.max_streams >= 4, "must be 4 or more"),
        ("prepare_threads", args.prepare_threads >= 1, "must be 1 or more"),
        ("prepare_queue", args.prepare_queue >= 1, "must be 1 or more"),
        ("max_body_bytes", args.max_body_bytes > 0, "must be greater than 0"),
        ("scrape_interval_s", args.scrape_interval_s > 0, "must be greater than 0"),
        ("scrape_cpu_budget", 0 < args.scrape_cpu_budget <= 1, "must be in (0, 1]"),
        ("scrape_timeout_s", args.scrape_timeout_s > 0, "must be greater than 0"),
        ("models_interval_s", args.models_interval_s >= 0, "must be 0 (off) or more"),
        ("stale_after_s", args.stale_after_s >= 0, "must be 0 (no scraping) or more"),
        ("drain_s", args.drain_s >= 0, "must be 0 or more"),
        ("session_ttl_s", args.session_ttl_s >= 0, "must be 0 (off) or more"),
        ("redis_maxlen", args.redis_maxlen >= 1, "must be 1 or more"),
        ("v", args.v >= 0, "must be 0 or more"),
        ("config_poll_s", args.config_poll_s >= 0, "must be 0 (only on SIGHUP) or more"),
        ("view_snapshot_max_age_s", args.view_snapshot_max_age_s > 0, "must be greater than 0"),
    )
    for name, ok, rule in rules:
        if not ok:
            raise ConfigError(f"--{name.replace('_', '-')} {rule}, got {getattr(args, name)}")
    if args.view_snapshot is not None and not args.view_snapshot.parent.is_dir():
        raise ConfigError(  # else found only at the drain, when the write fails
            f"--view-snapshot: no directory {args.view_snapshot.parent} to write it in"
        )
    if args.view_snapshot_dir is not None and not args.view_snapshot_dir.is_dir():
        raise ConfigError(f"--view-snapshot-dir: {args.view_snapshot_dir} is not a directory")
    tls_settings(args)
    check_tracing_args(args)
    if str(args.log_level).lower() not in _LOG_LEVELS:
        raise ConfigError(
            f"--log-level must be one of {', '.join(_LOG_LEVELS)}, got {args.log_level!r}"
        )


def tls_settings(args: argparse.Namespace) -> TlsSettings:
    """``--grpc-tls`` and its files.

    Raises:
        ConfigError: a mode without the files it needs, or files it does not use.
    """
    return TlsSettings(
        args.grpc_tls, args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file
    )


def start(args: argparse.Namespace, registry: CollectorRegistry = REGISTRY) -> Running:
    """Build and start the picker from parsed ``serve`` arguments.

    Raises:
        ConfigError: a bad flag, configuration or pods source.
        OSError: a port cannot be bound (the message names the address).
    """
    check_args(args)
    in_flight = InFlight()
    sticky = bool(args.session_header) and args.session_ttl_s > 0
    sessions = SessionStore(ttl_s=args.session_ttl_s) if sticky else None
    text, source = config_text(args.config)
    config = parse_config(text, source)
    scheduler = build_scheduler(config, registry, in_flight, sessions)
    flow = replace(
        parse_flow_control(config.flow_control, config.source), scraped=args.stale_after_s > 0
    )
    _check_hold_fits_envoy(flow)
    rewrites = parse_model_rewrites(config.model_rewrites, config.source)
    sharing = None
    if args.redis_url:
        try:
            sharing = RedisSharing(
                args.redis_url,
                stream=args.redis_stream,
                maxlen=args.redis_maxlen,
                registry=registry,
            )
        except ValueError as exc:
            raise ConfigError(f"--redis-url: {exc}") from None  # the URL may hold a password
    router = Router(
        scheduler,
        num_fallbacks=args.num_fallbacks,
        session_header=args.session_header or None,
        max_body_bytes=args.max_body_bytes,
        rendering=Rendering(args.prompt_rendering),
        in_flight=in_flight,
        registry=registry,
        carry_records=args.record_metadata == "on" and args.protocol != "epp",
        preparing=PreparePool(args.prepare_threads, args.prepare_queue),
        share=sharing.publish if sharing is not None else None,
        flow=flow,
        rewrites=rewrites,
    )
    if args.request_metrics == "on":
        router.observers.append(OutcomeMetrics(registry))  # per-request outcomes
    if args.log_picks:
        router.observers.append(PickLog())  # a log line per decision and end
    reloader = ConfigReloader(router, args.config, text, config, registry, args.config_poll_s)
    tracing = start_tracing(args)
    if tracing is not None:
        router.observers.append(tracing.observer)
    kv_events = _kv_events_subscriber(args, scheduler.listeners, registry)
    scraping = args.stale_after_s > 0

    def publish(pods: tuple[Pod, ...]) -> None:
        """A pod snapshot, to the router and to the KV-events subscriber (its publishers)."""
        router.set_pods(pods)
        if kv_events is not None:
            kv_events.set_pods(pods)

    store = PodStore(publish, stale_after_s=args.stale_after_s if scraping else None)
    watcher = make_pods_source(args, store.set_pods)
    store.set_pods(watcher.pods)
    # A rule's target no known pod serves is refused; with no pod known yet (a Kubernetes
    # source lists when started, below), it is answered 404 per request.
    known_at_load = bool(router.pods)
    check_targets(rewrites, router.pods)
    objectives = None
    if router.flow is not None:
        objectives = make_objectives_watcher(args, router.flow.objectives.set_watched)

    watched_rules = WatchedRules()

    def watched_rewrites(objects: tuple[WatchedRewrite, ...]) -> None:
        """The InferenceModelRewrites' rules, in force at once; a target no pod serves is
        said (its requests are answered 404), as an object cannot be refused."""
        rules = watched_rules.parse(objects)
        try:
            check_targets(rules, router.pods)
        except ConfigError as exc:
            log.warning("%s; its requests are answered 404", exc)
        router.set_watched_rewrites(rules)

    rewrite_watcher = make_rewrites_watcher(args, watched_rewrites)
    scraper = None
    if scraping:
        scraper = make_scraper(args, store, registry)
    grpc_server, grpc_port = make_grpc_server(
        router,
        f"{args.address}:{args.grpc_port}",
        process=epp_process(router) if args.protocol == "epp" else None,
        max_streams=args.max_streams,
        max_message_bytes=args.max_body_bytes + GRPC_MESSAGE_HEADROOM_BYTES,
        server_kind=args.grpc_server,
        credentials=server_credentials(tls_settings(args), names=(args.address,)),
    )
    health_server, servicer, health_port = make_health_server(f"{args.address}:{args.health_port}")
    snapshot = make_snapshot(args, registry)  # its metrics on the page from the first scrape
    metrics_server = None
    if args.metrics_port:
        try:
            metrics_server, _ = start_http_server(args.metrics_port, args.address, registry)
        except OSError as exc:
            raise OSError(
                f"cannot bind the metrics server to {args.address}:{args.metrics_port}: "
                f"{exc.strerror or exc}"
            ) from None
    # Bound before anything starts: a bad --admin-port or a taken port stops start-up here.
    admin = start_admin(args, router, config.source, store, kv_events)
    if admin is not None:
        add_status_page(admin)  # GET /, and its recent picks on the router's observers
    grpc_server.start()
    health_server.start()
    watcher.start()
    if not known_at_load:  # a Kubernetes source has listed them now
        check_targets(rewrites, router.pods)
    if snapshot is not None:  # before Redis's window, which is newer; and the events
        pods = {pod.id for pod in router.pods}
        snapshot.load(snapshot_views(scheduler), pods, precise_views(scheduler, kv_events))
    if objectives is not None:
        objectives.start()
    if rewrite_watcher is not None:
        rewrite_watcher.start()
    if scraper is not None:
        scraper.start()
    if sharing is not None:
        sharing.start(router)
    if kv_events is not None:
        kv_events.start()
    reloader.start()
    set_serving(servicer, True)
    log.info(
        "extproc %s serving ext_proc on %s:%d, health on :%d, metrics on :%s; %d pods from "
        "%s; record metadata %s; %s; kernels %s",
        router.replica_id,
        args.address,
        grpc_port,
        health_port,
        args.metrics_port,
        len(router.pods),
        describe_source(args),
        "on" if router.carry_records else "off",
        f"sharing through redis stream {args.redis_stream}" if sharing else "no sharing",
        KERNELS_IMPLEMENTATION,
    )
    return Running(
        router,
        grpc_server,
        grpc_port,
        health_server,
        servicer,
        health_port,
        watcher,
        scraper,
        metrics_server,
        registry,
        sharing,
        kv_events,
        objectives,
        rewrite_watcher,
        tracing,
        reloader=reloader,
        admin=admin,
        snapshot=snapshot,
    )


def make_scraper(
    args: argparse.Namespace, store: PodStore, registry: CollectorRegistry
) -> MetricsScraper | ScrapeProcess:
    """The pods' scraper, in a child process or a thread (``--scraper``)."""
    options = ScrapeOptions(
        interval_s=args.scrape_interval_s,
        timeout_s=args.scrape_timeout_s,
        cpu_budget=args.scrape_cpu_budget,
        models_interval_s=args.models_interval_s,
    )
    if args.scraper == "process":
        return ScrapeProcess(store, options, registry=registry)
    return MetricsScraper.with_options(store, options, registry=registry)


def make_snapshot(args: argparse.Namespace, registry: CollectorRegistry) -> ViewSnapshot | None:
    """The view snapshot of ``--view-snapshot`` or ``--view-snapshot-dir`` (this
    replica's file named by ``POD_NAME``, else the host name: a pod's own name)."""
    max_age_s = args.view_snapshot_max_age_s
    if args.view_snapshot is not None:
        return ViewSnapshot(args.view_snapshot, max_age_s, registry, time.time)
    if args.view_snapshot_dir is not None:
        replica = os.environ.get("POD_NAME") or socket.gethostname()
        return ViewSnapshot(args.view_snapshot_dir, max_age_s, registry, time.time, replica)
    return None


def precise_views(scheduler: Scheduler, kv_events: KvEventsSubscriber | None) -> list[PreciseView]:
    """The token-exact view the KV-events subscriber feeds, for the view snapshot."""
    if kv_events is None:
        return []
    return [
        PreciseView(plugin.type_name, plugin.index, kv_events.next_sequences, kv_events.resume)
        for plugin in plugins_of(scheduler).values()
        if isinstance(plugin, PrecisePrefixCache) and plugin.index is kv_events.index
    ]


def snapshot_views(scheduler: Scheduler) -> list[View]:
    """The approximate prefix views of ``scheduler``'s plugins, for ``--view-snapshot``."""
    views = []
    for plugin in plugins_of(scheduler).values():
        if isinstance(plugin, PrefixCacheScorer | EstimatedTTFT):
            index, tag = plugin.index, plugin.metrics.model_tag(RESTORED_MODEL)
        elif isinstance(plugin, PrecisePrefixCache):
            index, tag = plugin.approx, 0  # untagged: it has no eviction metric
        else:
            continue
        size, blocks = plugin.args.blockSizeToHash, plugin.args.maxBlocksToMatch
        views.append(View(plugin.type_name, index, size, blocks, plugin.recorded.age, tag))
    return views


def _check_hold_fits_envoy(flow: FlowConfig) -> None:
    """Warn when a hold can outlast the Envoy message timeout the generated configuration
    allows: Envoy ignores a longer override and answers 504 at ``message_timeout``."""
    longest = flow.longest_ttl_s + HOLD_MARGIN_S
    if flow.enabled and longest > DEFAULT_MAX_MESSAGE_TIMEOUT_S:
        log.warning(
            "flow control holds a request up to %.0f s (its longest time to live plus %.0f s),"
            " above the %.0f s max_message_timeout Envoy's generated configuration allows by"
            " default: generate it with --max-message-timeout-s %.0f or more (the chart:"
            " envoy.maxMessageTimeoutSeconds), or held requests get 504",
            longest,
            HOLD_MARGIN_S,
            DEFAULT_MAX_MESSAGE_TIMEOUT_S,
            math.ceil(longest),
        )


def _kv_events_subscriber(
    args: argparse.Namespace, plugins: Iterable[object], registry: CollectorRegistry
) -> KvEventsSubscriber | None:
    """The KV-events subscriber feeding precise-prefix-cache, when it is configured."""
    precise = next((p for p in plugins if isinstance(p, PrecisePrefixCache)), None)
    if precise is None:
        return None
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    subscriber = KvEventsSubscriber(precise.index, settings, registry)
    log.info("precise-prefix-cache: KV events, %s", settings)
    return subscriber
