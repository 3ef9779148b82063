"""What tracing costs per routed request: the CPU of extproc's pick span (``PickTracer``),
off, at 1% and at 100% sampling.

Each case tells the observer the same decision ``--requests`` times and reports the
process CPU per request (the calling thread's, and the whole process's: the batch
exporter's thread included, which encodes every span as OTLP protobuf as the real
exporter does, but sends nothing). Cases:

- off: no tracer (``serve`` without ``--otlp-endpoint``): nothing is called;
- 1% by Envoy: Envoy samples 1% (``envoy-config --trace-sampling 0.01``) and sends its
  trace context; extproc follows (99 in 100 parents unsampled);
- 1% by extproc: no trace context (Envoy not tracing), ``--trace-sampling 0.01``;
- 100%: every request traced by Envoy.

``--through-envoy N`` also sends N requests one at a time through real Envoy, extproc
and simulated pods, tracing off, at 1% and at 100% (Envoy's and extproc's spans to an
OTLP receiver in this process), and reports Envoy's and extproc's CPU per request.

    python -m bench.tracing_cost [--requests 20000] [--through-envoy 3000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager

import grpc
import httpx
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from bench.picker import cpu_seconds
from extproc.admin.tracing import PickTracer, make_provider
from extproc.routing.observe import Routed, RouteObserver, tell_routed
from extproc.sim.launch import run_stack, spawn_sim_pods
from testkit.factories import make_pod

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PODS = tuple(make_pod(f"p{i}", port=8000 + i) for i in range(3))


class EncodingExporter(SpanExporter):
    """Encodes each batch as the OTLP exporter does, then drops it (no network)."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        encode_spans(spans).SerializeToString()
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


def decision(traceparent: str | None) -> Routed:
    return Routed(
        request_id="5e1f0c2a-8a2e-4b4e-9d61-2f0b8a7c9e10",
        model="Qwen/Qwen3-0.6B",
        headers={"traceparent": traceparent} if traceparent else {},
        arrived_unix_ns=time.time_ns(),
        arrived_s=100.0,
        decided_s=100.0002,
        queued_s=0.0,
        preparing_s=0.0,
        num_candidates=16,
        pods=PODS,
        prefill=None,
        pinned=False,
        prompt_tokens=2048,
        predicted_cached_tokens=1920,
        exact=False,
    )


def parents(share_sampled: float | None, n: int) -> list[Routed]:
    """``n`` decisions; with ``share_sampled`` each carries Envoy's trace context, that
    share of them sampled; None: none carries one."""
    if share_sampled is None:
        return [decision(None)] * n
    every = round(1 / share_sampled) if share_sampled else n + 1
    return [
        decision(f"00-{TRACE_ID}-{i + 1:016x}-{'01' if i % every == 0 else '00'}") for i in range(n)
    ]


def measure(
    observers: list[RouteObserver], routed: list[Routed], done: Callable[[], None]
) -> tuple[float, float]:
    """(calling thread's, whole process's) CPU microseconds per request."""
    process, thread = time.process_time(), time.thread_time()
    for r in routed:
        tell_routed(observers, r)
    thread_us = (time.thread_time() - thread) / len(routed) * 1e6
    done()  # flushes the batch: its encoding counts
    return thread_us, (time.process_time() - process) / len(routed) * 1e6


def case(sampling: float, routed: list[Routed]) -> tuple[float, float, int]:
    exporter = EncodingExporter()
    processor = BatchSpanProcessor(exporter, max_queue_size=len(routed) + 1)
    provider = make_provider("extproc", sampling, processor)
    tracer = PickTracer(provider.get_tracer("extproc"))
    thread_us, process_us = measure([tracer], routed, provider.shutdown)
    return thread_us, process_us, exporter.spans


class CountingReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector that counts the spans of each service."""

    def __init__(self) -> None:
        self.spans: dict[str, int] = {}

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            name = next(
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            )
            count = sum(len(scope.spans) for scope in resource_spans.scope_spans)
            self.spans[name] = self.spans.get(name, 0) + count
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def receiver() -> Iterator[tuple[CountingReceiver, int]]:
    counting = CountingReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(counting, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield counting, port
    finally:
        server.stop(0).wait(2)


def through_envoy(n: int) -> None:
    """Envoy's and extproc's CPU per request, tracing off, at 1% and at 100%."""
    model = "sim-llm"
    body = {"model": model, "prompt": "You are a helpful assistant. " * 40, "max_tokens": 1}
    print(f"\n{n} requests one at a time through Envoy; CPU us per request (envoy / extproc)")
    with spawn_sim_pods(4, args=["--model", model]) as sim, receiver() as (counting, port):
        for name, sampling in (("off", None), ("1%", 0.01), ("100%", 1.0)):
            endpoint = f"127.0.0.1:{port}"
            traced = sampling is not None
            with (
                run_stack(
                    sim.as_pods(),
                    envoy_options={"otlp_endpoint": endpoint, "trace_sampling": sampling}
                    if traced
                    else None,
                    extproc_args=["--otlp-endpoint", endpoint, "--trace-sampling", str(sampling)]
                    if traced
                    else [],
                ) as stack,
                httpx.Client(base_url=stack.url, timeout=30) as client,
            ):
                for _ in range(200):  # warm-up
                    client.post("/v1/completions", json=body).raise_for_status()
                before = cpu_seconds(stack.envoy.pid), cpu_seconds(stack.extproc.pid)
                for _ in range(n):
                    client.post("/v1/completions", json=body).raise_for_status()
                envoy_us = (cpu_seconds(stack.envoy.pid) - before[0]) / n * 1e6
                extproc_us = (cpu_seconds(stack.extproc.pid) - before[1]) / n * 1e6
            print(f"{name:6} {envoy_us:7.0f} / {extproc_us:7.0f}   spans so far {counting.spans}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--through-envoy", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)
    n = args.requests
    print(f"{n} decisions per case; CPU us per request (thread / process incl. export)")
    off_thread, off_process = measure([], parents(None, n), lambda: None)
    print(f"{'off (no tracer)':28} {off_thread:7.2f} / {off_process:7.2f}   spans 0")
    for name, sampling, share in (
        ("1% sampled by Envoy", 0.01, 0.01),
        ("1% sampled by extproc", 0.01, None),
        ("100% (Envoy traces all)", 1.0, 1.0),
    ):
        case(sampling, parents(share, 1000))  # warm-up
        thread_us, process_us, spans = case(sampling, parents(share, n))
        print(f"{name:28} {thread_us:7.2f} / {process_us:7.2f}   spans {spans}")
    if args.through_envoy:
        through_envoy(args.through_envoy)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
