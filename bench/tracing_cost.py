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

    python -m bench.tracing_cost [--requests 20000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from extproc.admin.tracing import PickTracer, make_provider
from extproc.routing.observe import Routed, RouteObserver, tell_routed
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    n = parser.parse_args(argv).requests
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
