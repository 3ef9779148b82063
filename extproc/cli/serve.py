"""``extproc serve``: the endpoint picker process's flags, and its life until a signal.

Every flag has an environment variable (``EXTPROC_<FLAG>``) and an embedded default,
except the pods source: without ``--pods`` or a Kubernetes source serve refuses to start
(exit 2), rather than serve pods nobody named. ``app.start`` wires the pieces;
SIGTERM/SIGINT drain (``Running.stop``) and exit; SIGHUP reloads the ``--config`` file
(``admin.reload``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from extproc.admin.json_log import JsonFormatter, StderrRecords, log_uncaught
from extproc.admin.reload import add_reload_arguments
from extproc.admin.server import add_admin_arguments
from extproc.admin.tracing import add_tracing_arguments
from extproc.cli import CLI_REFERENCE
from extproc.cli.app import check_args, start
from extproc.datalayer.kv_events import add_events_arguments
from extproc.datalayer.sources import add_source_arguments
from extproc.errors import ConfigError
from extproc.prefix.snapshot import add_snapshot_arguments
from extproc.request.parse import DEFAULT_MAX_BODY_BYTES
from extproc.request.render import Rendering
from extproc.routing.preparing import DEFAULT_MAX_WAITING, DEFAULT_THREADS
from extproc.routing.sharing import DEFAULT_MAXLEN, DEFAULT_STREAM
from extproc.wire.server import GRPC_SERVERS
from extproc.wire.tls import TLS_MODES

log = logging.getLogger("extproc.serve")


def _env(name: str, default: Any) -> Any:
    return os.environ.get(f"EXTPROC_{name.upper().replace('-', '_')}", default)


DESCRIPTION = f"""\
Run the endpoint picker: Envoy's ext_proc filter sends it each request body, and it
answers with the pods to try, best first. It runs until SIGTERM or SIGINT, then drains.

Most common:
  extproc serve --pods pods.yaml                                 pods listed in a file
  extproc serve --k8s-selector app=vllm --k8s-target-port 8000   pods from Kubernetes
  extproc serve --inference-pool my-pool                         an InferencePool's pods

It needs one source of pods, --pods or Kubernetes (--k8s-selector, --inference-pool);
without one it refuses to start. Every flag can also be set in the environment as
EXTPROC_<FLAG> (--grpc-port: EXTPROC_GRPC_PORT); the defaults shown include those.
Generate Envoy's configuration with `extproc envoy-config`. Documentation: the site
`make docs` builds from docs/ (docs/configuration.md; every flag in {CLI_REFERENCE})."""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="run the endpoint picker (needs --pods or a Kubernetes source)",
        usage="extproc serve (--pods FILE | --k8s-selector SEL --k8s-target-port PORT | "
        "--inference-pool NAME) [options]",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group(
        "Envoy and gRPC", "the port Envoy's ext_proc filter and access log use"
    )
    g.add_argument(
        "--address",
        default=_env("address", "127.0.0.1"),
        help="bind address (default: %(default)s)",
    )
    g.add_argument(
        "--grpc-port",
        type=int,
        default=_env("grpc-port", "9002"),
        help="ext_proc and access log port (default: %(default)s)",
    )
    g.add_argument(
        "--protocol",
        choices=("one-round", "epp"),
        default=_env("protocol", "one-round"),
        help="one-round: extproc's own Envoy config (envoy/, envoy-config); epp: gateways "
        "speaking the Endpoint Picker Protocol (headers first, body buffered or "
        "full-duplex streamed, destination header + metadata) (default: %(default)s)",
    )
    g.add_argument(
        "--grpc-server",
        choices=GRPC_SERVERS,
        default=_env("grpc-server", "auto"),
        help="loop: the one-thread server on grpcio's private core binding (the fastest); "
        "public: grpcio's public grpc.server (a thread per open stream); auto: loop when "
        "the installed grpcio passes its self-check at start-up, else public (the log says "
        "which and why) (default: %(default)s)",
    )
    g.add_argument(
        "--max-streams",
        type=int,
        default=_env("max-streams", "4096"),
        help="gRPC streams open at once: one per request being routed (EPP: for the "
        "request's whole life) and one access log per Envoy worker; streams beyond are "
        "refused at once (default: %(default)s streams)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=_env("max-body-bytes", str(DEFAULT_MAX_BODY_BYTES)),
        help="largest request body routed; a larger one is answered 413 "
        "(default: %(default)s bytes)",
    )
    g.add_argument(
        "--drain-s",
        type=float,
        default=_env("drain-s", "10.0"),
        help="on SIGTERM, how long the requests in flight may take to end and be recorded "
        "(default: %(default)s s)",
    )
    g = p.add_argument_group("health and metrics")
    g.add_argument(
        "--health-port",
        type=int,
        default=_env("health-port", "9003"),
        help="gRPC health service port (default: %(default)s)",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=_env("metrics-port", "9090"),
        help="Prometheus /metrics port (default: %(default)s)",
    )
    g.add_argument(
        "--request-metrics",
        choices=("on", "off"),
        default=_env("request-metrics", "on"),
        help="per-request outcome metrics per model and pod (first byte, duration, bytes, "
        "attempts, predicted cached tokens) from Envoy's access log; off spares their "
        "series where pods are many (default: %(default)s)",
    )
    g = p.add_argument_group("routing", "the scheduler and what a reply lists")
    g.add_argument(
        "--config",
        default=_env("config", None),
        help="scheduler configuration YAML, or a shipped one by name: default, kthena, "
        "cost-aware (default: the shipped default)",
    )
    g.add_argument(
        "--num-fallbacks",
        type=int,
        default=_env("num-fallbacks", "2"),
        help="pods listed after the pick, for Envoy's retries (default: %(default)s pods)",
    )
    g.add_argument(
        "--session-header",
        default=_env("session-header", "x-session-id"),
        help="request header carrying the session key, '' to ignore sessions "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--session-ttl-s",
        type=float,
        default=_env("session-ttl-s", "600"),
        help="session sticky: a session's binding lasts this long after its last use; "
        "0 turns session sticky off (default: %(default)s s)",
    )
    g.add_argument(
        "--prompt-rendering",
        choices=[r.value for r in Rendering],
        default=_env("prompt-rendering", Rendering.EXTENDED.value),
        help="where the prompt is read from: extended: the path's own field (list and "
        "token-id completions prompts routed); kthena: Kthena's prompt/messages/input "
        "order for every path, to the letter (default: %(default)s)",
    )
    g.add_argument(
        "--prepare-threads",
        type=int,
        default=_env("prepare-threads", str(DEFAULT_THREADS)),
        help="threads that prepare requests off the gRPC loop: precise-prefix-cache "
        "tokenizes there the prompt segments its memo lacks (default: %(default)s threads)",
    )
    g.add_argument(
        "--prepare-queue",
        type=int,
        default=_env("prepare-queue", str(DEFAULT_MAX_WAITING)),
        help="requests waiting for or in preparation at most; beyond, a request is routed "
        "at once without it (precise-prefix-cache: from its approximate view, counted "
        "as reason busy) (default: %(default)s requests)",
    )
    add_source_arguments(p, _env)
    g = p.add_argument_group("scraping", "each pod's /metrics: its queue, KV-cache use, latency")
    g.add_argument(
        "--scrape-interval-s",
        type=float,
        default=_env("scrape-interval-s", "0.2"),
        help="how often each pod's /metrics is scraped (default: %(default)s s)",
    )
    g.add_argument(
        "--scrape-timeout-s",
        type=float,
        default=_env("scrape-timeout-s", "1.0"),
        help="one scrape's time limit (default: %(default)s s)",
    )
    g.add_argument(
        "--scrape-cpu-budget",
        type=float,
        default=_env("scrape-cpu-budget", "0.1"),
        help="the share of one core scraping may take; with many pods the sweeps are "
        "spaced out to fit, and pods stay fresh for 3 sweeps (default: %(default)s of a core)",
    )
    g.add_argument(
        "--scraper",
        choices=("process", "thread"),
        default=_env("scraper", "process"),
        help="where the scrapes run: a child process, off the routing process's GIL (a "
        "sweep over many pods otherwise delays the requests arriving meanwhile), or a "
        "thread of the routing process (default: %(default)s)",
    )
    g.add_argument(
        "--stale-after-s",
        type=float,
        default=_env("stale-after-s", "2.0"),
        help="a pod without a fresh scrape this long is not ready; 0: no scraping, "
        "readiness from the pods source only (default: %(default)s s)",
    )
    g = p.add_argument_group("replicas and Redis", "several extprocs sharing one view")
    g.add_argument(
        "--record-metadata",
        choices=("on", "off"),
        default=_env("record-metadata", "on"),
        help="one-round: each route reply carries the request's record (model, session, "
        "block keys, pods listed; at most about 1.5 KB) as extproc.record metadata, which "
        "Envoy's access log "
        "brings back, so whichever replica receives the log can record the request "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--redis-url",
        default=_env("redis-url", ""),
        help="share the view with the other replicas through this Redis (e.g. "
        "redis://redis:6379/0): each publishes what it records and applies the others'; "
        "'' for a single replica (default: '', no sharing)",
    )
    g.add_argument(
        "--redis-stream",
        default=_env("redis-stream", DEFAULT_STREAM),
        help="the Redis stream the replicas share (default: %(default)s)",
    )
    g.add_argument(
        "--redis-maxlen",
        type=int,
        default=_env("redis-maxlen", str(DEFAULT_MAXLEN)),
        help="entries the stream keeps (about): what a (re)started replica catches up "
        "from (default: %(default)s entries)",
    )
    g = p.add_argument_group("TLS", "the gRPC port's transport")
    g.add_argument(
        "--grpc-tls",
        choices=TLS_MODES,
        default=_env("grpc-tls", "off"),
        help="off (plaintext); self-signed (TLS, a certificate made at start-up, for "
        "gateways that do not verify it); files (TLS with --tls-cert-file/--tls-key-file, "
        "re-read when they change); mtls (files, and every client must present a "
        "certificate from --tls-client-ca-file) (default: %(default)s)",
    )
    g.add_argument(
        "--tls-cert-file",
        type=Path,
        default=_env("tls-cert-file", None),
        help="the server's certificate chain, PEM (--grpc-tls files or mtls) (default: none)",
    )
    g.add_argument(
        "--tls-key-file",
        type=Path,
        default=_env("tls-key-file", None),
        help="its private key, PEM (--grpc-tls files or mtls) (default: none)",
    )
    g.add_argument(
        "--tls-client-ca-file",
        type=Path,
        default=_env("tls-client-ca-file", None),
        help="CA bundle that signs the clients' certificates (--grpc-tls mtls) (default: none)",
    )
    add_events_arguments(p, _env)
    add_tracing_arguments(p, _env)
    add_reload_arguments(p, _env)
    add_admin_arguments(p, _env)
    add_snapshot_arguments(p, _env)
    g = p.add_argument_group("logging")
    g.add_argument(
        "--log-level",
        default=_env("log-level", "info"),
        help="debug, info, warning, error or critical (default: %(default)s)",
    )
    g.add_argument(
        "-v",
        "--v",  # klog's spelling, as Kthena's router is started: --v=4
        dest="v",
        type=int,
        default=_env("v", "0"),
        help="verbosity; 4 logs every score plugin's per-pod scores and the final scores "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=_env("log-format", "text"),
        help="text: one line for people; json: one JSON object a line (time, level, "
        "logger, message and the record's fields) (default: %(default)s)",
    )
    g.add_argument(
        "--log-picks",
        action=argparse.BooleanOptionalAction,
        default=_env("log-picks", "false").lower() in ("1", "true", "yes", "on"),
        help="a log line per routing decision (request id, model, pick, fallbacks, "
        "predicted cached tokens, time queued) and per end (served by, succeeded, "
        "duration) on logger extproc.picks; costs CPU per request (default: %(default)s)",
    )
    p.set_defaults(func=run)


LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def check_logging_args(args: argparse.Namespace) -> None:
    """Raises: ConfigError: a --log-format not in ``LOG_FORMATS`` (from the environment:
    argparse checks only the command line's)."""
    if args.log_format not in LOG_FORMATS:
        raise ConfigError(
            f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {args.log_format!r}"
        )


def configure_logging(level: str, verbosity: int, log_format: str = "text") -> StderrRecords | None:
    """The root logger to stderr, as text or JSON lines (``admin.json_log``). With JSON,
    what else reaches stderr (gRPC's C core, a thread's uncaught exception, a warning)
    is a JSON record too; returns what to close at exit then."""
    captured = StderrRecords() if log_format == "json" else None
    handler = logging.StreamHandler(captured.stream if captured else None)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.captureWarnings(True)
    threading.excepthook = log_uncaught
    if verbosity >= 4:
        logging.getLogger("extproc.scheduling").setLevel(logging.DEBUG)
    if verbosity >= 5:
        logging.getLogger("extproc").setLevel(logging.DEBUG)
    return captured


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
        check_logging_args(args)
    except ConfigError as exc:
        print(f"extproc serve: cannot start: {exc}", file=sys.stderr)
        return 2
    captured = configure_logging(args.log_level, args.v, args.log_format)
    try:
        return _serve(args)
    finally:
        if captured is not None:
            captured.close()


def _serve(args: argparse.Namespace) -> int:
    stop = threading.Event()
    hangup = threading.Event()  # SIGHUP: reload the configuration (``admin.reload``)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()  # nothing else here: the handler may interrupt any code, logging included

    def on_hangup(signum: int, _frame: FrameType | None) -> None:
        hangup.set()  # likewise: the reload runs in the loop below

    # Installed before anything listens, so a SIGTERM right after start-up still drains.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    try:
        running = start(args)
    except (ConfigError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    while not stop.wait(0.5):
        if hangup.is_set():
            hangup.clear()
            if running.reloader is not None:
                running.reloader.reload_now()
    log.info("signal received: draining for up to %.1f s", args.drain_s)
    running.stop(args.drain_s)
    log.info("stopped")
    return 0
