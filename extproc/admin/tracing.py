"""OpenTelemetry tracing: one span per routed request, continuing the trace Envoy started.

``serve --otlp-endpoint HOST:PORT`` turns it on: ``PickTracer`` is a route observer that
turns each ``Routed`` into a span (``extproc pick``, kind SERVER) from the moment
extproc had the whole request to the moment it picked, with the model, the candidates,
the pick and fallbacks, the predicted cached tokens and the time queued and preparing.
Its parent is the trace context Envoy sends on the ext_proc stream (``traceparent``,
the ext_proc call's span, a child of Envoy's request span; ``wire.one_round`` passes it
among the headers), so one trace holds Envoy's spans and extproc's pick. Spans go out in
batches over OTLP gRPC, off the request path.

Sampling is ``ParentBased(TraceIdRatioBased(--trace-sampling))``: a request Envoy traces
is traced here, one it does not is not, and the ratio applies only to requests that
come without a trace context. An unsampled request costs a string test (its parent's
flags) or the SDK's sampler call, and no attributes are built for it.

OpenTelemetry is an extra (``pip install 'extproc[tracing]'``): nothing here imports it
until tracing is turned on, so the base install neither needs nor loads it.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from extproc.errors import ConfigError
from extproc.routing.observe import Ended, Routed

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.trace import Tracer

log = logging.getLogger("extproc.tracing")

SPAN_NAME = "extproc pick"
INSTALL_HINT = "pip install 'extproc[tracing]'"
# xds-protos ships an old copy of the OpenTelemetry protos in the same files as
# opentelemetry-proto's; whichever pip installs last wins.
PROTOS_CLOBBERED = (
    "the OpenTelemetry protos in place are xds-protos' older copy (both packages install "
    "opentelemetry/proto), which the OTLP exporter cannot use: pip install "
    "--force-reinstall --no-deps opentelemetry-proto"
)
# When extproc starts a trace itself (no trace context from Envoy). Envoy's own ratio
# (envoy-config --trace-sampling) decides for the requests it traces.
DEFAULT_SAMPLING = 0.01
TRACEPARENT = "traceparent"
# One export's deadline, retries included: a collector that is down costs the exporter
# thread this long per batch (its spans are then dropped), and the stop at most this.
EXPORT_TIMEOUT_S = 2.0
# traceparent ends with its flags in hex: an even last digit is the sampled bit unset.
_UNSAMPLED_LAST_DIGITS = frozenset("02468aceACE")


def add_tracing_arguments(p: argparse.ArgumentParser, env: Callable[[str, Any], Any]) -> None:
    """``serve``'s tracing flags, each with its ``EXTPROC_<FLAG>`` default."""
    g = p.add_argument_group(
        "tracing", f"OpenTelemetry spans of each pick, over OTLP gRPC (needs {INSTALL_HINT})"
    )
    g.add_argument(
        "--otlp-endpoint",
        default=env("otlp-endpoint", ""),
        help="OpenTelemetry collector's OTLP gRPC endpoint (host:port, http://host:port, "
        "or https://host:port for TLS); '' turns tracing off (default: '', off)",
    )
    g.add_argument(
        "--trace-sampling",
        type=float,
        default=env("trace-sampling", str(DEFAULT_SAMPLING)),
        help="share of requests traced when Envoy sent no trace context, 0 to 1; a request "
        "Envoy traces is always traced, one it does not never is (default: %(default)s)",
    )
    g.add_argument(
        "--trace-service-name",
        default=env("trace-service-name", "extproc"),
        help="service.name on extproc's spans (default: %(default)s)",
    )


def check_tracing_args(args: argparse.Namespace) -> None:
    """Raises: ConfigError: a sampling ratio outside [0, 1], naming the flag."""
    if not 0 <= args.trace_sampling <= 1:
        raise ConfigError(f"--trace-sampling must be in [0, 1], got {args.trace_sampling}")


class PickTracer:
    """A route observer: one span per routed request (``routed``); ends add nothing."""

    __slots__ = ("_extract", "_kind", "_tracer")

    def __init__(self, tracer: Tracer) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = tracer
        self._kind = SpanKind.SERVER
        self._extract: Callable[[Mapping[str, str]], Context] = (
            TraceContextTextMapPropagator().extract
        )

    def routed(self, routed: Routed) -> None:
        parent = routed.headers.get(TRACEPARENT)
        if parent is not None and parent[-1:] in _UNSAMPLED_LAST_DIGITS:
            return  # the parent was not sampled: neither is this (ParentBased), for free
        span = self._tracer.start_span(
            SPAN_NAME,
            context=self._extract(routed.headers) if parent is not None else None,
            kind=self._kind,
            start_time=routed.arrived_unix_ns,
            record_exception=False,
            set_status_on_exception=False,
        )
        if not span.is_recording():
            return
        span.set_attributes(span_attributes(routed))
        span.end(routed.arrived_unix_ns + round((routed.decided_s - routed.arrived_s) * 1e9))

    def ended(self, ended: Ended) -> None:
        pass


def span_attributes(routed: Routed) -> dict[str, str | int | float | bool | list[str]]:
    """What a pick's span says: the request, the candidates, the pods listed, the cost."""
    attributes: dict[str, str | int | float | bool | list[str]] = {
        "extproc.model": routed.model,
        "extproc.candidates": routed.num_candidates,
        "extproc.fallbacks": [pod.address for pod in routed.pods[1:]],
        "extproc.prompt_tokens": routed.prompt_tokens,
        "extproc.predicted_cached_tokens": routed.predicted_cached_tokens,
        "extproc.exact": routed.exact,
        "extproc.pinned": routed.pinned,
        "extproc.queued_s": routed.queued_s,
        "extproc.preparing_s": routed.preparing_s,
    }
    if routed.pods:
        attributes["extproc.pick.address"] = routed.pods[0].address
        attributes["extproc.pick.pod"] = str(routed.pods[0].id)
    if routed.prefill is not None:
        attributes["extproc.prefill.pod"] = str(routed.prefill.id)
    if routed.request_id is not None:
        attributes["extproc.request_id"] = routed.request_id
    return attributes


class Tracing:
    """Started tracing: the provider (its batch exporter thread) and the observer."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.observer = PickTracer(provider.get_tracer("extproc"))

    def stop(self) -> None:
        """Export the spans still batched, then stop the exporter."""
        self.provider.shutdown()


def make_provider(
    service_name: str, sampling: float, processor: SpanProcessor | None = None
) -> TracerProvider:
    """A tracer provider sampling ``ParentBased(TraceIdRatioBased(sampling))``, exporting
    through ``processor`` (tests pass an in-memory one).

    Raises:
        ConfigError: OpenTelemetry is not installed (the ``tracing`` extra).
    """
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError:
        raise ConfigError(
            f"--otlp-endpoint needs OpenTelemetry, which is not installed: {INSTALL_HINT}"
        ) from None
    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(sampling)),
        resource=Resource.create({SERVICE_NAME: service_name}),
    )
    if processor is not None:
        provider.add_span_processor(processor)
    return provider


def start_tracing(args: argparse.Namespace) -> Tracing | None:
    """Tracing as ``serve``'s flags ask: None without ``--otlp-endpoint`` (and then
    OpenTelemetry is never imported).

    Raises:
        ConfigError: a bad flag, or OpenTelemetry not installed.
    """
    check_tracing_args(args)
    endpoint: str = args.otlp_endpoint
    if not endpoint:
        return None
    provider = make_provider(args.trace_service_name, args.trace_sampling)
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        if "InstrumentationScope" in str(exc):
            raise ConfigError(f"--otlp-endpoint: {PROTOS_CLOBBERED}") from None
        raise ConfigError(
            f"--otlp-endpoint needs the OTLP exporter, which is not installed: {INSTALL_HINT}"
        ) from None
    exporter = OTLPSpanExporter(
        endpoint=endpoint,
        insecure=not endpoint.startswith("https://"),
        timeout=EXPORT_TIMEOUT_S,
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info(
        "tracing: spans to %s, sampling %g of requests without a trace context",
        endpoint,
        args.trace_sampling,
    )
    return Tracing(provider)
