"""``extproc envoy-config``: write an Envoy bootstrap (and the snippet) for a pods file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from extproc.cli import CLI_REFERENCE
from extproc.datalayer.pods_file import load_pods
from extproc.envoyconf.build import make_bootstrap, make_snippet
from extproc.envoyconf.options import EnvoyOptions
from extproc.envoyconf.render import render_bootstrap, render_snippet
from extproc.errors import ConfigError

_DEFAULTS = EnvoyOptions()
_ONE_POD_SOURCE = (
    "give the pods Envoy may send to: a pods file (--pods FILE) or DNS "
    "(--pods-dns NAME:PORT), one of the two"
)


DESCRIPTION = f"""\
Write the configuration of an Envoy that sends every request through extproc: a whole
bootstrap, and optionally the snippet to add to an Envoy you already run.

Most common:
  extproc envoy-config --pods pods.yaml --extproc-address 127.0.0.1:9002 -o envoy.yaml
  extproc envoy-config --pods-dns vllm-headless:8000 --extproc-address extproc:9002 \\
      --listen-address 0.0.0.0 -o envoy.yaml

Then run `envoy -c envoy.yaml` beside `extproc serve`. Documentation: the site `make docs`
builds from docs/ (docs/configuration.md; every flag in {CLI_REFERENCE})."""


def register(subparsers: Any) -> None:
    """Add the ``envoy-config`` sub-command."""
    parser = subparsers.add_parser(
        "envoy-config",
        help="write an Envoy bootstrap and snippet routing through extproc",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--pods",
        type=Path,
        help="pods YAML file: every pod Envoy may send to, e.g. the repository's "
        "examples/pods.yaml (default: none; this or --pods-dns is required)",
    )
    parser.add_argument(
        "--pods-dns",
        metavar="NAME:PORT",
        help="take the pods from DNS instead of --pods, e.g. a Kubernetes headless Service "
        "(default: none; this or --pods is required)",
    )
    parser.add_argument(
        "--extproc-address",
        default=_DEFAULTS.extproc_address,
        help="extproc gRPC server, ip:port or dns-name:port; several replicas "
        "comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--listen-address",
        default=_DEFAULTS.listen_address,
        help="Envoy's listener address (default: %(default)s)",
    )
    parser.add_argument(
        "--listen-port",
        type=int,
        default=_DEFAULTS.listen_port,
        help="Envoy's listener port (default: %(default)s)",
    )
    parser.add_argument(
        "--admin-port",
        type=int,
        default=_DEFAULTS.admin_port,
        help="Envoy's admin port (default: %(default)s)",
    )
    parser.add_argument(
        "--num-fallbacks",
        type=int,
        default=_DEFAULTS.num_fallbacks,
        help="retries, each on the next pod extproc lists (default: %(default)s)",
    )
    parser.add_argument(
        "--failure-mode-allow",
        action="store_true",
        help="when extproc is down or late, route round-robin instead of 500/504 (default: off)",
    )
    parser.add_argument(
        "--message-timeout-s",
        type=float,
        default=_DEFAULTS.message_timeout_s,
        help="wait for extproc's reply to the body (default: %(default)s s)",
    )
    parser.add_argument(
        "--max-message-timeout-s",
        type=float,
        default=_DEFAULTS.max_message_timeout_s,
        help="longest wait extproc may ask for while flow control holds a request; keep it "
        "above the longest queue time to live + 2 s (default: %(default)s s)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=_DEFAULTS.max_body_bytes,
        help="largest request body, 413 above (default: %(default)s bytes)",
    )
    parser.add_argument(
        "--attribute-header",
        dest="attribute_headers",
        action="append",
        metavar="NAME",
        help="request header sent to extproc, repeatable "
        f"(default: {', '.join(_DEFAULTS.attribute_headers)})",
    )
    parser.add_argument(
        "--extproc-tls",
        action="store_true",
        help="TLS towards extproc, for extproc serve --grpc-tls self-signed, files or mtls "
        "(default: off)",
    )
    parser.add_argument(
        "--extproc-ca-file",
        help="CA that verifies extproc's certificate (default: none: not verified, for "
        "--grpc-tls self-signed)",
    )
    parser.add_argument("--extproc-sni", help="server name (default: the extproc host)")
    parser.add_argument(
        "--extproc-client-cert-file", help="Envoy's certificate, for mTLS (default: none)"
    )
    parser.add_argument("--extproc-client-key-file", help="Envoy's key, for mTLS (default: none)")
    parser.add_argument(
        "--otlp-endpoint",
        metavar="HOST:PORT",
        help="turn on Envoy's OpenTelemetry tracing, exporting spans over OTLP gRPC to this "
        "collector; extproc's pick span (serve --otlp-endpoint) joins Envoy's trace "
        "(default: none, no tracing)",
    )
    parser.add_argument(
        "--trace-sampling",
        type=float,
        default=_DEFAULTS.trace_sampling,
        metavar="RATIO",
        help="share of requests Envoy traces, 0 to 1; extproc follows Envoy's decision "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--output", "-o", type=Path, help="write the bootstrap here (default: stdout)"
    )
    parser.add_argument(
        "--snippet",
        type=Path,
        help="also write the snippet for an existing Envoy here (default: none)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the files; bad input prints one line to stderr and returns 2."""
    if (args.pods is None) == (args.pods_dns is None):
        print(f"extproc envoy-config: {_ONE_POD_SOURCE}", file=sys.stderr)
        return 2
    try:
        pods = () if args.pods_dns else load_pods(args.pods)
        options = EnvoyOptions(
            extproc_address=args.extproc_address,
            listen_address=args.listen_address,
            listen_port=args.listen_port,
            admin_port=args.admin_port,
            num_fallbacks=args.num_fallbacks,
            failure_mode_allow=args.failure_mode_allow,
            message_timeout_s=args.message_timeout_s,
            max_message_timeout_s=args.max_message_timeout_s,
            max_body_bytes=args.max_body_bytes,
            attribute_headers=tuple(args.attribute_headers or _DEFAULTS.attribute_headers),
            pods_dns=args.pods_dns,
            extproc_tls=args.extproc_tls,
            extproc_ca_file=args.extproc_ca_file,
            extproc_sni=args.extproc_sni,
            extproc_client_cert_file=args.extproc_client_cert_file,
            extproc_client_key_file=args.extproc_client_key_file,
            otlp_endpoint=args.otlp_endpoint,
            trace_sampling=args.trace_sampling,
        )
    except (ConfigError, ValueError) as exc:
        print(f"extproc envoy-config: {exc}", file=sys.stderr)
        return 2
    source = (
        f"pods from DNS {args.pods_dns}"
        if args.pods_dns
        else f"{len(pods)} pods from {args.pods.name}"
    )
    summary = f"{source}, extproc at {options.extproc_address}"
    if options.otlp_endpoint:
        summary += f", traced to {options.otlp_endpoint}"
    bootstrap = render_bootstrap(make_bootstrap(pods, options), summary=summary)
    if args.output is None:
        sys.stdout.write(bootstrap)
    else:
        args.output.write_text(bootstrap, encoding="utf-8")
    if args.snippet is not None:
        args.snippet.write_text(
            render_snippet(make_snippet(pods, options), summary=summary), encoding="utf-8"
        )
    return 0
