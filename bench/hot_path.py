"""The request path in process: extproc's own per-request work, without gRPC or Envoy.

Each request is what the loop server does with one routed request, from the parsed
ext_proc message to the parsed access-log message: ``RouteHandler.process_soon`` (read
the attributes, parse and render the body, hash, schedule, serialize the reply with its
record) and ``AccessLogHandler.complete`` (the entry read, the pending request ended and
recorded, the observers told). The messages are built as Envoy sends them (the access
log carries the reply's dynamic metadata back). The router is built as ``extproc serve``
builds it with the shipped defaults (configuration, flow control, sessions, record
metadata, per-request metrics), over instant pods that are never scraped.

It is the profiling companion of ``bench.instructions`` (which counts the same work plus
gRPC core behind real Envoy): quick to run, and ``--profile`` says where the time goes.

    python -m bench.hot_path                          # 8 KB chat prompts, 16 pods
    python -m bench.hot_path --prompt-kb 220 --pods 1000 --profile
    python -m bench.hot_path --in-flight 16     # each request ended 16 requests later
    python -m bench.hot_path --prefixes 100000 --warm-up 2000   # every prompt new (no memo)
    python -m bench.hot_path --flame docs/img/hot-path-flame.svg   # py-spy's flame graph
    python -m bench.hot_path --precise DIR --events   # precise, the pods' KV events too
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import orjson
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from prometheus_client import CollectorRegistry

from bench.floor import precise_config
from bench.loadgen import ID_MARK, chat_body
from bench.pyspy import finish_recording, start_recording
from bench.upstreams import MODEL
from extproc.datalayer.kv_events import apply_event
from extproc.pods import Pod, PodId
from extproc.prefix.precise.keys import chain_keys
from extproc.request.parse import Api
from extproc.routing.flow.config import parse_flow_control
from extproc.routing.outcome_metrics import OutcomeMetrics
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, default_config_text, parse_config
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.scheduling.sessions import SessionStore
from extproc.wire.access_log import AccessLogHandler
from extproc.wire.one_round import RouteHandler
from extproc.wire.protocol import ATTRIBUTES_KEY, PATH_ATTRIBUTE, REQUEST_ID_ATTRIBUTE
from testkit.wire import log_entry

PATH = "/v1/chat/completions"


def make_pods(num_pods: int) -> list[Pod]:
    return [
        Pod(
            id=PodId("bench", f"pod-{i}"),
            address=f"127.0.{i // 250}.{i % 250 + 1}:8000",
            models=frozenset({MODEL}),
        )
        for i in range(num_pods)
    ]


def make_router(
    num_pods: int, registry: CollectorRegistry, config_text: str, pod_in_flight: int = 1
) -> Router:
    """The router ``extproc serve`` builds with its defaults, over instant pods, each
    taking up to ``pod_in_flight`` requests before flow control holds the next (unscraped
    pods count only extproc's in-flight requests: ``maxWaiting``)."""
    in_flight = InFlight()
    config = parse_config(config_text, "bench.hot_path")
    scheduler = build_scheduler(config, registry, in_flight, SessionStore(ttl_s=600))
    flow = replace(
        parse_flow_control(config.flow_control, config.source),
        scraped=False,
        max_waiting=max(1, pod_in_flight),
    )
    router = Router(
        scheduler,
        make_pods(num_pods),
        in_flight=in_flight,
        registry=registry,
        carry_records=True,
        flow=flow,
    )
    router.observers.append(OutcomeMetrics(registry))
    return router


def body_message(body: bytes, request_id: str) -> bytes:
    """The ext_proc message Envoy sends: the buffered body with its attributes."""
    message = ep.ProcessingRequest(
        request_body=ep.HttpBody(body=body, end_of_stream=True),
    )
    fields = message.attributes[ATTRIBUTES_KEY].fields
    fields[PATH_ATTRIBUTE].string_value = PATH
    fields[REQUEST_ID_ATTRIBUTE].string_value = request_id
    return bytes(message.SerializeToString())


def log_message(request_id: str, served: str, metadata: struct_pb2.Struct | None) -> bytes:
    """The access-log message Envoy sends when the request has ended successfully."""
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.append(
        log_entry(request_id, served, metadata=metadata, first_byte_ns=2_000_000)
    )
    return bytes(message.SerializeToString())


class HotPath:
    """Requests over ``num_prefixes`` prompts of ``prompt_bytes``, each routed and ended
    ``in_flight`` requests later (0: at once), as under load with that many requests in
    flight."""

    def __init__(
        self,
        num_pods: int,
        prompt_bytes: int,
        num_prefixes: int,
        config_text: str | None = None,
        in_flight: int = 0,
    ) -> None:
        """``config_text``: the scheduler configuration (default: the shipped one)."""
        self.registry = CollectorRegistry()
        self.router = make_router(
            num_pods, self.registry, config_text or default_config_text(), in_flight + 1
        )
        self.routes = RouteHandler(self.router)
        self.logs = AccessLogHandler(self.router)
        head, tail = chat_body(prompt_bytes).split(ID_MARK.encode())
        self.bodies = [head + f"{i:08d}".encode() + tail for i in range(num_prefixes)]
        self.next_id = 0
        self.in_flight = in_flight
        self._unended: deque[bytes] = deque()
        self._served: deque[tuple[int, str]] = deque()  # each unended request's body, pod
        self._events: KvEvents | None = None

    def with_events(self) -> None:
        """From now on each request's end is followed by the served pod's KV event for its
        prompt (precise configuration only)."""
        self._events = KvEvents(self.router, self.bodies)

    def one_request(self) -> None:
        n = self.next_id
        self.next_id += 1
        request_id = f"req-{n}"
        message = ep.ProcessingRequest.FromString(
            body_message(self.bodies[n % len(self.bodies)], request_id)
        )
        routed = self.routes.process_soon(message)
        if isinstance(routed, Future):  # prepared on the preparing threads (tokenizing)
            routed = routed.result()
        assert isinstance(routed, tuple), routed
        reply = ep.ProcessingResponse.FromString(routed[0])
        served = (
            reply.dynamic_metadata.fields["envoy.lb"]
            .struct_value.fields["x-gateway-destination-endpoint"]
            .string_value.split(",")[0]
        )
        self._unended.append(log_message(request_id, served, reply.dynamic_metadata))
        self._served.append((n % len(self.bodies), served))
        if len(self._unended) > self.in_flight:
            self.end_oldest()

    def end_oldest(self) -> None:
        """The access log of the oldest request not ended yet (then its pod's KV event)."""
        self.logs.complete(als_pb2.StreamAccessLogsMessage.FromString(self._unended.popleft()))
        body, served = self._served.popleft()
        if self._events is not None:
            self._events.stored(body, served)


class KvEvents:
    """What the pods' KV events tell precise-prefix-cache, as its subscriber applies them
    (``kv_events.apply_event``): a pod that served a prompt stores the full blocks it did
    not find cached, one ``BlockStored`` a request chained from the last block it found,
    as vLLM's ``BlockPool.cache_full_blocks`` publishes them (the engine hashes are the
    plugin's own keys: one per prefix, as the engine's are)."""

    def __init__(self, router: Router, bodies: list[bytes]) -> None:
        precise = [
            s.scorer for s in router.scheduler.scorers if isinstance(s.scorer, PrecisePrefixCache)
        ]
        if not precise:
            raise SystemExit("--events needs --precise")
        self.plugin = precise[0]
        self.pod_by_address = {p.address: p.id for p in router.pods}
        tokenizer = self.plugin.tokenizers[MODEL]
        self.tokens = [
            tokenizer.request_tokens(Api.CHAT_COMPLETIONS, orjson.loads(b)) for b in bodies
        ]
        self.keys = [chain_keys(t, self.plugin.args.blockSize) for t in self.tokens]

    def stored(self, body: int, served: str) -> None:
        size = self.plugin.args.blockSize
        tokens, keys = self.tokens[body], self.keys[body]
        pod = self.pod_by_address[served]
        # vLLM's hit: the cached blocks from the start, never the prompt's last token
        hit = min(self.plugin.index.match(pod, keys)[0], (len(tokens) - 1) // size)
        if hit >= len(keys):
            return
        event = {
            "type": "BlockStored",
            "block_hashes": keys[hit:],
            "parent_block_hash": keys[hit - 1] if hit else None,
            "token_ids": tokens[hit * size : len(keys) * size],
            "block_size": size,
        }
        apply_event(self.plugin.index, pod, event)


def flame(path: HotPath, out: Path, seconds: float) -> None:
    """Requests for ``seconds`` while py-spy samples this process (after the warm-up,
    so the graph is the steady request path, not the imports)."""
    recording = start_recording(os.getpid(), seconds, out, "flamegraph")
    deadline = time.monotonic() + seconds + 1.0  # py-spy attaches, then samples
    while time.monotonic() < deadline:
        path.one_request()
    finish_recording(recording, seconds)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--prompt-kb", type=int, default=8)
    parser.add_argument("--prefixes", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--in-flight", type=int, default=0, help="requests routed and not ended yet, as under load"
    )
    parser.add_argument(
        "--precise",
        type=Path,
        metavar="MODEL_DIR",
        help="the shipped precise configuration, with this tokenizer (its memo warm after "
        "the warm-up; no KV events: the cost measured is the tokenizing's)",
    )
    parser.add_argument(
        "--events",
        action="store_true",
        help="with --precise: each request's end stores its prompt's blocks in the served "
        "pod's view, as its KV events would (the events' cost is counted)",
    )
    parser.add_argument(
        "--warm-up", type=int, help="requests before the rounds (default: two per prefix)"
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--flame", type=Path, help="also write py-spy's flame graph (SVG) here")
    parser.add_argument("--flame-s", type=float, default=10.0, help="seconds sampled")
    args = parser.parse_args()
    config_text = None
    if args.precise is not None:
        with tempfile.TemporaryDirectory() as work_dir:
            config_text = precise_config(args.precise, Path(work_dir)).read_text()
    path = HotPath(args.pods, args.prompt_kb * 1024, args.prefixes, config_text, args.in_flight)
    if args.events:
        path.with_events()
    for _ in range(2 * args.prefixes if args.warm_up is None else args.warm_up):
        path.one_request()
    samples = []
    for _ in range(args.rounds):
        t0 = time.perf_counter_ns()
        for _ in range(args.requests):
            path.one_request()
        samples.append((time.perf_counter_ns() - t0) / 1000 / args.requests)
    print(f"{statistics.median(samples):.1f} us/request (rounds: {samples})")
    if args.flame:
        flame(path, args.flame, args.flame_s)
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.requests):
            path.one_request()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
