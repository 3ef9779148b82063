"""What the observability on by default costs per request, measured where it is spent.

extproc's wire path in one process, on the default configuration and 16 pods: each
request's ext_proc body message through ``RouteHandler.process`` and its access-log entry
through ``AccessLogHandler.complete``, real protobuf messages as Envoy sends them. Two
routers take turns, ``--rounds`` times, in turn first: the default (its per-request observers: the
outcome metrics) and the bare one (``--request-metrics off``: no observer, so no
decision or end record is built). The CPU per request is the process's; the difference
is what the observers add. bench.floor's ``--variants bare`` measures the same through
real Envoy, where the machine's noise between runs (10% and more on 2 shared cores) is
larger than the difference.

    python -m bench.observability_cost [--prompt-kb 8,220] [--requests 3000] [--rounds 8]
        [--json FILE] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import orjson
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from prometheus_client import CollectorRegistry

from bench.picker_report import machine
from extproc.pods import Pod
from extproc.routing.outcome_metrics import OutcomeMetrics
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, load_config
from extproc.scheduling.inflight import InFlight
from extproc.wire.access_log import AccessLogHandler
from extproc.wire.one_round import RouteHandler
from extproc.wire.protocol import ATTRIBUTES_KEY, PATH_ATTRIBUTE, REQUEST_ID_ATTRIBUTE
from testkit.factories import make_pod

PATH = "/v1/chat/completions"
TENANTS = 32  # system prompts: the pods' views warm, as in bench.floor's workload

Handlers = tuple[RouteHandler, AccessLogHandler]


def handlers(pods: list[Pod], observed: bool) -> Handlers:
    """A router on the default configuration, with its outcome metrics or with none."""
    registry, in_flight = CollectorRegistry(), InFlight()
    scheduler = build_scheduler(load_config(None), registry, in_flight, None)
    router = Router(scheduler, pods, registry=registry, in_flight=in_flight)
    if observed:
        router.observers.append(OutcomeMetrics(registry))
    return RouteHandler(router), AccessLogHandler(router)


def body_message(i: int, prompt_bytes: int) -> ep.ProcessingRequest:
    system = f"tenant {i % TENANTS} " + "x" * prompt_bytes
    body = {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": f"question {i}"}]}  # fmt: skip
    message = ep.ProcessingRequest()
    message.request_body.body = orjson.dumps(body)
    message.request_body.end_of_stream = True
    attributes = message.attributes[ATTRIBUTES_KEY].fields
    attributes[PATH_ATTRIBUTE].string_value = PATH
    attributes[REQUEST_ID_ATTRIBUTE].string_value = f"r{i}"
    return message


def log_message(i: int, served: str) -> als_pb2.StreamAccessLogsMessage:
    """A successful request's entry, with the times and sizes Envoy fills in."""
    message = als_pb2.StreamAccessLogsMessage()
    entry = message.http_logs.log_entry.add()
    entry.request.request_id = f"r{i}"
    entry.request.request_headers_bytes, entry.request.request_body_bytes = 300, 9000
    entry.response.response_code.value = 200
    entry.response.response_headers_bytes, entry.response.response_body_bytes = 200, 900
    common = entry.common_properties
    common.time_to_first_upstream_rx_byte.nanos = 40_000_000
    common.time_to_last_downstream_tx_byte.nanos = 900_000_000
    host, port = served.split(":")
    common.upstream_remote_address.socket_address.address = host
    common.upstream_remote_address.socket_address.port_value = int(port)
    return message


def cpu_us_per_request(
    pair: Handlers, bodies: list[ep.ProcessingRequest], logs: list[als_pb2.StreamAccessLogsMessage]
) -> float:
    route, access_log = pair
    gc.collect()
    started = time.process_time()
    for body, log in zip(bodies, logs, strict=True):
        route.process(body)
        access_log.complete(log)
    return (time.process_time() - started) / len(bodies) * 1e6


def measure(prompt_kb: int, requests: int, rounds: int) -> dict[str, Any]:
    """Both routers on the same messages, alternating, ``rounds`` times each."""
    pods = [make_pod(f"p{i}", port=8000 + i) for i in range(16)]
    bodies = [body_message(i, prompt_kb * 1024) for i in range(requests)]
    logs = [log_message(i, pods[i % len(pods)].address) for i in range(requests)]
    pairs = {"bare": handlers(pods, False), "default": handlers(pods, True)}
    for pair in pairs.values():  # warm: views, memos, label children
        cpu_us_per_request(pair, bodies, logs)
    runs: dict[str, list[float]] = {name: [] for name in pairs}
    for r in range(rounds):  # ABBA: neither goes second every round
        for name, pair in sorted(pairs.items(), reverse=bool(r % 2)):
            runs[name].append(round(cpu_us_per_request(pair, bodies, logs), 2))
    added = [d - b for d, b in zip(runs["default"], runs["bare"], strict=True)]
    return {
        "prompt_kb": prompt_kb,
        "requests": requests,
        "runs_us": runs,
        "bare_us": round(statistics.median(runs["bare"]), 1),
        "default_us": round(statistics.median(runs["default"]), 1),
        "added_us": round(statistics.median(added), 1),
    }


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], rounds: int) -> str:
    lines = [
        "# What the observability on by default costs per request (bench.observability_cost)",
        "",
        (
            f"{info['cpu_model']}, {info['cores']} cores; commit {info['git_sha'][:12]}; "
            f"the default configuration, 16 pods; the wire path in one process (body "
            f"message in, access-log entry in); medians of {rounds} rounds, each router first every other round."
        ),
        "",
        "| prompt | bare us/req | default us/req | added us/req (median of the rounds') |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt_kb']} KB | {r['bare_us']:.0f} | {r['default_us']:.0f} | "
            f"{r['added_us']:+.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--prompt-kb", default="8,220", type=lambda s: [int(x) for x in s.split(",")]
    )
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    rows = []
    for kb in args.prompt_kb:
        requests = args.requests if kb < 64 else max(200, args.requests // 5)
        rows.append(measure(kb, requests, args.rounds))
        print(json.dumps(rows[-1]), flush=True)
    info = machine()
    text = markdown(rows, info, args.rounds)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "rows": rows}, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
