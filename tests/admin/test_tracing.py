"""Tracing: a pick's span (its times and attributes), its parent from Envoy's trace context
(which the wire layer takes from the stream's metadata), sampling, and the base install
never loading OpenTelemetry."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from extproc.admin.tracing import (
    SPAN_NAME,
    PickTracer,
    add_tracing_arguments,
    check_tracing_args,
    make_provider,
)
from extproc.errors import ConfigError
from extproc.pods import Pod
from extproc.routing.observe import Routed
from extproc.routing.router import Router
from testkit.factories import PREFIX_ONLY, make_pod, make_scheduler
from testkit.wire import BODY, Server, body, headers, routed_body

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
SAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-01"
UNSAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-00"
PODS = (make_pod("p0", port=8000), make_pod("p1", port=8001), make_pod("p2", port=8002))


class Spans:
    """A tracer feeding an in-memory exporter, as ``serve`` builds it but for the export."""

    def __init__(self, sampling: float) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider: TracerProvider = make_provider(
            "extproc-test", sampling, SimpleSpanProcessor(self.exporter)
        )
        self.observer = PickTracer(self.provider.get_tracer("test"))

    def finished(self) -> tuple[ReadableSpan, ...]:
        return self.exporter.get_finished_spans()


@pytest.fixture
def spans() -> Iterator[Spans]:
    made = Spans(1.0)
    yield made
    made.provider.shutdown()


def routed(
    headers: dict[str, str] | None = None,
    *,
    pods: tuple[Pod, ...] = PODS,
    prefill: Pod | None = None,
) -> Routed:
    return Routed(
        request_id="req-1",
        model="m",
        headers=headers or {},
        arrived_unix_ns=1_700_000_000_000_000_000,
        arrived_s=100.0,
        decided_s=100.25,
        queued_s=0.125,
        preparing_s=0.0625,
        num_candidates=3,
        pods=pods,
        prefill=prefill,
        pinned=False,
        prompt_tokens=400,
        predicted_cached_tokens=384,
        exact=True,
    )


def test_a_pick_is_one_span_from_arrival_to_decision_with_its_attributes(spans: Spans) -> None:
    spans.observer.routed(routed(prefill=make_pod("pf", port=9000)))
    (span,) = spans.finished()
    assert span.name == SPAN_NAME and span.kind is SpanKind.SERVER
    assert span.start_time == 1_700_000_000_000_000_000
    assert span.end_time == 1_700_000_000_250_000_000
    assert span.resource.attributes["service.name"] == "extproc-test"
    assert dict(span.attributes or {}) == {
        "extproc.model": "m",
        "extproc.candidates": 3,
        "extproc.pick.address": PODS[0].address,
        "extproc.pick.pod": str(PODS[0].id),
        "extproc.fallbacks": (PODS[1].address, PODS[2].address),
        "extproc.prefill.pod": "default/pf",
        "extproc.prompt_tokens": 400,
        "extproc.predicted_cached_tokens": 384,
        "extproc.exact": True,
        "extproc.pinned": False,
        "extproc.queued_s": 0.125,
        "extproc.preparing_s": 0.0625,
        "extproc.request_id": "req-1",
    }


def test_the_span_continues_the_trace_of_its_traceparent(spans: Spans) -> None:
    spans.observer.routed(routed({"traceparent": SAMPLED}))
    (span,) = spans.finished()
    assert span.parent is not None and span.parent.is_remote
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID


def test_without_a_trace_context_the_span_starts_a_trace(spans: Spans) -> None:
    spans.observer.routed(routed())
    (span,) = spans.finished()
    assert span.parent is None and format(span.context.trace_id, "032x") != TRACE_ID


@pytest.mark.parametrize("flags", ["00", "02"])
def test_a_request_envoy_did_not_sample_makes_no_span(spans: Spans, flags: str) -> None:
    spans.observer.routed(routed({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-{flags}"}))
    assert spans.finished() == ()


def test_the_ratio_decides_for_requests_without_a_trace_context() -> None:
    never, always = Spans(0.0), Spans(1.0)
    for _ in range(20):
        never.observer.routed(routed())
        always.observer.routed(routed())
    assert len(never.finished()) == 0 and len(always.finished()) == 20
    # a sampled parent is followed whatever the ratio
    never.observer.routed(routed({"traceparent": SAMPLED}))
    assert len(never.finished()) == 1


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_tracing_arguments(parser, lambda _name, default: default)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("ratio", ["-0.1", "1.5", "nan"])
def test_a_sampling_ratio_outside_0_to_1_is_refused_naming_the_flag(ratio: str) -> None:
    with pytest.raises(ConfigError, match="--trace-sampling"):
        check_tracing_args(parse("--trace-sampling", ratio))


def test_tracing_is_off_by_default() -> None:
    args = parse()
    assert args.otlp_endpoint == "" and args.trace_service_name == "extproc"
    check_tracing_args(args)


@pytest.mark.parametrize("kind", ["loop", "public"])
def test_the_trace_context_in_the_streams_metadata_reaches_the_observers(kind: str) -> None:
    """Envoy sends the ext_proc call's span context in the gRPC metadata, not as a header."""
    router = Router(make_scheduler(PREFIX_ONLY), list(PODS), registry=CollectorRegistry())
    spans = Spans(1.0)
    router.observers.append(spans.observer)
    with Server("one-round", router, kind) as server:
        server.one_round.process(
            iter([routed_body("r1", BODY)]),
            metadata=(("traceparent", SAMPLED), ("tracestate", ""), ("x-other", "1")),
            timeout=5,
        )
        server.one_round.process(iter([routed_body("r2", BODY)]), timeout=5)
    first, second = spans.finished()
    assert first.parent is not None and format(first.parent.span_id, "016x") == PARENT_ID
    assert second.parent is None  # a stream without trace context starts its own
    spans.provider.shutdown()


def test_the_epp_protocol_takes_the_trace_context_from_the_metadata_too() -> None:
    router = Router(make_scheduler(PREFIX_ONLY), list(PODS), registry=CollectorRegistry())
    spans = Spans(1.0)
    router.observers.append(spans.observer)
    with Server("epp", router, "loop") as server:
        call = server.bidi(
            iter([headers(rid="r1"), body()]), metadata=(("traceparent", SAMPLED),), timeout=5
        )
        replies = [next(call), next(call)]  # to the headers, then the route
        call.cancel()
    assert replies[1].request_body.response.HasField("header_mutation")  # routed
    (span,) = spans.finished()
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_ID
    spans.provider.shutdown()


_SERVE = """\
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ImportError(f"{name} is blocked")

sys.meta_path.insert(0, Blocked())
from prometheus_client import CollectorRegistry
from extproc.cli import build_parser
from extproc.cli.app import start
from extproc.errors import ConfigError

args = build_parser().parse_args(["serve", *sys.argv[1:]])
try:
    running = start(args, CollectorRegistry())
except ConfigError as exc:
    print("refused:", exc)
    raise SystemExit(0)
running.stop(0)
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
print("started; opentelemetry modules:", loaded)
"""


def _serve_without_opentelemetry(tmp_path: Path, *flags: str) -> str:
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods:\n  - {name: p0, address: 127.0.0.1:8000, models: [m]}\n")
    base = ["--pods", str(pods), "--grpc-port", "0", "--health-port", "0", "--metrics-port", "0"]
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SERVE), *base, "--stale-after-s", "0", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout


def test_serve_without_an_endpoint_never_imports_opentelemetry(tmp_path: Path) -> None:
    out = _serve_without_opentelemetry(tmp_path)
    assert "started; opentelemetry modules: []" in out


def test_an_endpoint_without_the_extra_is_refused_naming_the_install(tmp_path: Path) -> None:
    out = _serve_without_opentelemetry(tmp_path, "--otlp-endpoint", "127.0.0.1:4317")
    assert "refused:" in out and "pip install 'extproc[tracing]'" in out


_CLOBBERED = """
import sys

class Clobbered:
    # What the exporter's import raises when xds-protos' old protos won (CI saw it).
    def find_spec(self, name, path=None, target=None):
        if name.startswith("opentelemetry.exporter"):
            raise ImportError(
                "cannot import name 'InstrumentationScope' from "
                "'opentelemetry.proto.common.v1.common_pb2'"
            )

sys.meta_path.insert(0, Clobbered())
from extproc.admin.tracing import start_tracing
from extproc.cli import build_parser
from extproc.errors import ConfigError

args = build_parser().parse_args(["serve", "--pods", "p.yaml", "--otlp-endpoint", "h:4317"])
try:
    start_tracing(args)
except ConfigError as exc:
    print("refused:", exc)
"""


def test_protos_overwritten_by_xds_protos_are_named_with_the_fix() -> None:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CLOBBERED)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "xds-protos" in result.stdout
    assert "pip install --force-reinstall --no-deps opentelemetry-proto" in result.stdout
