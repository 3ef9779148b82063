"""``extproc serve``: the endpoint picker process.

Wires the pieces: configuration -> scheduler; pods file (watched) and each pod's scraped
/metrics -> pod store -> router; gRPC
ext_proc + access log on ``--grpc-port``; gRPC health on ``--health-port``; Prometheus
metrics on ``--metrics-port``. SIGTERM/SIGINT: health goes NOT_SERVING, open streams get
``--drain-s`` seconds to finish, then the process exits.

Every flag has an environment variable (``EXTPROC_<FLAG>``) and an embedded default, so
``extproc serve`` alone serves the shipped pods file with the shipped configuration.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from extproc.config import build_scheduler, load_config
from extproc.datalayer.scrape import MetricsScraper
from extproc.datalayer.sources import (
    PodsSource,
    add_source_arguments,
    describe_source,
    make_pods_source,
)
from extproc.datalayer.store import PodStore
from extproc.errors import ConfigError
from extproc.gateway import epp_process
from extproc.grpc_loop import LoopServer
from extproc.routing import Router
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.sessions import SessionStore
from extproc.server import (
    ACCESS_LOG_PATH,
    EXT_PROC_SERVICE,
    ExtProcHandlers,
    make_grpc_server,
    make_health_server,
)

log = logging.getLogger("extproc.serve")

STOP_GRACE_S = 2.0  # beyond --drain-s, for the servers to confirm they stopped


def _env(name: str, default: Any) -> Any:
    return os.environ.get(f"EXTPROC_{name.upper().replace('-', '_')}", default)


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "serve", help="run the ext_proc endpoint picker", description=__doc__
    )
    p.add_argument("--config", default=_env("config", None), help="scheduler config YAML")
    p.add_argument("--address", default=_env("address", "127.0.0.1"), help="bind address")
    p.add_argument("--grpc-port", type=int, default=_env("grpc-port", "9002"))
    p.add_argument("--health-port", type=int, default=_env("health-port", "9003"))
    p.add_argument("--metrics-port", type=int, default=_env("metrics-port", "9090"))
    p.add_argument(
        "--num-fallbacks",
        type=int,
        default=_env("num-fallbacks", "2"),
        help="pods listed after the pick, for Envoy's retries (default %(default)s)",
    )
    p.add_argument(
        "--session-header",
        default=_env("session-header", "x-session-id"),
        help="request header carrying the session key ('' to ignore sessions)",
    )
    p.add_argument(
        "--session-ttl-s",
        type=float,
        default=_env("session-ttl-s", "600"),
        help="session sticky: a session's binding lasts this long after its last use; "
        "0 turns session sticky off (default %(default)s)",
    )
    p.add_argument(
        "--protocol",
        choices=("one-round", "epp"),
        default=_env("protocol", "one-round"),
        help="one-round: extproc's own Envoy config (envoy/, envoy-config); epp: gateways "
        "speaking the Endpoint Picker Protocol (headers first, body buffered or "
        "full-duplex streamed, destination header + metadata) (default %(default)s)",
    )
    p.add_argument(
        "--max-streams",
        type=int,
        default=_env("max-streams", "4096"),
        help="gRPC streams open at once: one per request being routed (EPP: for the "
        "request's whole life) and one access log per Envoy worker; streams beyond are "
        "refused at once (default %(default)s)",
    )
    p.add_argument("--max-body-bytes", type=int, default=_env("max-body-bytes", str(16 << 20)))
    p.add_argument(
        "--scrape-interval-s",
        type=float,
        default=_env("scrape-interval-s", "0.2"),
        help="how often each pod's /metrics is scraped (default %(default)s)",
    )
    p.add_argument("--scrape-timeout-s", type=float, default=_env("scrape-timeout-s", "1.0"))
    p.add_argument(
        "--scrape-cpu-budget",
        type=float,
        default=_env("scrape-cpu-budget", "0.1"),
        help="the share of one core scraping may take; with many pods the sweeps are "
        "spaced out to fit, and pods stay fresh for 3 sweeps (default %(default)s)",
    )
    p.add_argument(
        "--stale-after-s",
        type=float,
        default=_env("stale-after-s", "2.0"),
        help="a pod without a fresh scrape this long is not ready; 0: no scraping, "
        "readiness from the pods source only (default %(default)s)",
    )
    p.add_argument("--drain-s", type=float, default=_env("drain-s", "10.0"))
    p.add_argument("--log-level", default=_env("log-level", "info"))
    p.add_argument(
        "-v",
        type=int,
        default=_env("v", "0"),
        help="verbosity; 4 logs every score plugin's per-pod scores",
    )
    add_source_arguments(p, _env)
    p.set_defaults(func=run)


@dataclass
class Running:
    """A started picker; ``stop()`` drains and shuts everything down."""

    router: Router
    grpc_server: LoopServer
    grpc_port: int
    health_server: grpc.Server
    health_servicer: health.HealthServicer
    health_port: int
    watcher: PodsSource
    scraper: MetricsScraper | None
    metrics_server: Any
    registry: CollectorRegistry

    def stop(self, drain_s: float = 10.0) -> None:
        for service in ("", EXT_PROC_SERVICE):
            self.health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.watcher.stop()
        if self.scraper is not None:
            self.scraper.stop()
        # New ext_proc streams are refused (Envoy answers 500 or fails open); the access
        # logs of the requests in flight still come in and are recorded, until none is
        # pending or drain_s has passed.
        self.grpc_server.drain(keep=[ACCESS_LOG_PATH])
        in_flight, recorded = len(self.router.pending), self._recorded()
        deadline = time.monotonic() + drain_s
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
        if self.metrics_server is not None:
            self.metrics_server.shutdown()

    def _recorded(self) -> int:
        value = self.registry.get_sample_value("extproc_completions_total", {"outcome": "recorded"})
        return int(value or 0)


_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag values that cannot work, naming the flag (argparse checks only types).

    Raises:
        ConfigError: the first bad value.
    """
    for flag in ("grpc_port", "health_port", "metrics_port"):
        port = getattr(args, flag)
        if not 0 <= port <= 65535:  # grpcio would wrap 99999 to 34463 and serve there
            raise ConfigError(
                f"--{flag.replace('_', '-')} must be a port number from 0 to 65535, got {port}"
            )
    rules = (
        ("num_fallbacks", args.num_fallbacks >= 0, "must be 0 or more"),
        ("max_streams", args.max_streams >= 4, "must be 4 or more"),
        ("max_body_bytes", args.max_body_bytes > 0, "must be greater than 0"),
        ("scrape_interval_s", args.scrape_interval_s > 0, "must be greater than 0"),
        ("scrape_cpu_budget", 0 < args.scrape_cpu_budget <= 1, "must be in (0, 1]"),
        ("scrape_timeout_s", args.scrape_timeout_s > 0, "must be greater than 0"),
        ("stale_after_s", args.stale_after_s >= 0, "must be 0 (no scraping) or more"),
        ("drain_s", args.drain_s >= 0, "must be 0 or more"),
        ("session_ttl_s", args.session_ttl_s >= 0, "must be 0 (off) or more"),
        ("v", args.v >= 0, "must be 0 or more"),
    )
    for name, ok, rule in rules:
        if not ok:
            raise ConfigError(f"--{name.replace('_', '-')} {rule}, got {getattr(args, name)}")
    if str(args.log_level).lower() not in _LOG_LEVELS:
        raise ConfigError(
            f"--log-level must be one of {', '.join(_LOG_LEVELS)}, got {args.log_level!r}"
        )


def start(args: argparse.Namespace, registry: CollectorRegistry = REGISTRY) -> Running:
    """Build and start the picker from parsed ``serve`` arguments.

    Raises:
        ConfigError: a bad flag, configuration or pods source.
        OSError: a port cannot be bound (the message names the address).
    """
    check_args(args)
    in_flight = InFlight()
    scheduler = build_scheduler(load_config(args.config), registry, in_flight)
    if args.session_header and args.session_ttl_s > 0:
        scheduler.sessions = SessionStore(ttl_s=args.session_ttl_s)
    router = Router(
        scheduler,
        num_fallbacks=args.num_fallbacks,
        session_header=args.session_header or None,
        max_body_bytes=args.max_body_bytes,
        in_flight=in_flight,
        registry=registry,
    )
    scraping = args.stale_after_s > 0
    store = PodStore(router.set_pods, stale_after_s=args.stale_after_s if scraping else None)
    watcher = make_pods_source(args, store.set_pods)
    store.set_pods(watcher.pods)
    scraper = None
    if scraping:
        scraper = MetricsScraper(
            store,
            interval_s=args.scrape_interval_s,
            timeout_s=args.scrape_timeout_s,
            cpu_budget=args.scrape_cpu_budget,
            registry=registry,
        )
    grpc_server, grpc_port = make_grpc_server(
        ExtProcHandlers(router),
        f"{args.address}:{args.grpc_port}",
        process=epp_process(router) if args.protocol == "epp" else None,
        max_streams=args.max_streams,
        max_message_bytes=args.max_body_bytes + (1 << 20),
    )
    health_server, servicer, health_port = make_health_server(f"{args.address}:{args.health_port}")
    metrics_server = None
    if args.metrics_port:
        try:
            metrics_server, _ = start_http_server(args.metrics_port, args.address, registry)
        except OSError as exc:
            raise OSError(
                f"cannot bind the metrics server to {args.address}:{args.metrics_port}: "
                f"{exc.strerror or exc}"
            ) from None
    grpc_server.start()
    health_server.start()
    watcher.start()
    if scraper is not None:
        scraper.start()
    for service in ("", EXT_PROC_SERVICE):
        servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "extproc serving ext_proc on %s:%d, health on :%d, metrics on :%s; %d pods from %s",
        args.address,
        grpc_port,
        health_port,
        args.metrics_port,
        len(router.pods),
        describe_source(args),
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
    )


def configure_logging(level: str, verbosity: int) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if verbosity >= 4:
        logging.getLogger("extproc.scheduling").setLevel(logging.DEBUG)
    if verbosity >= 5:
        logging.getLogger("extproc").setLevel(logging.DEBUG)


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
    except ConfigError as exc:
        print(f"extproc serve: cannot start: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.v)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()  # nothing else here: the handler may interrupt any code, logging included

    # Installed before anything listens, so a SIGTERM right after start-up still drains.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        running = start(args)
    except (ConfigError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    while not stop.wait(1.0):
        pass
    log.info("signal received: draining for up to %.1f s", args.drain_s)
    running.stop(args.drain_s)
    log.info("stopped")
    return 0
