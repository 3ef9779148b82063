"""Several extproc replicas: lost records and hit ratio, today's behaviour beside the
record metadata and Redis sharing, on the demo's workload; and what a record costs.

Each contender runs the same workload (``extproc demo``'s: tenants with ~2.5 KB system
prompts, chat requests) through real Envoys in front of simulated vLLM pods whose prefix
caches are emptied before each run, and reports, summed over the replicas: requests
recorded (locally, from the metadata), ``unknown_request`` (lost), the pods' own
prefix-cache hit ratio and how many pods each tenant was spread over. Requests are sent
round robin over the Envoys. Then the per-request cost of a record: bytes added to the
reply and microseconds to build it, and to read it back, for 1 KB / 8 KB / 220 KB prompts.

    python -m bench.replicas --json bench/results/replicas.json \
        --markdown bench/results/replicas.md

The ``precise`` rows run ``extproc/data/precise.yaml``: every replica connects to every
pod's KV events (the pods bind a port each) and serves once its views are trusted. They
need ``--tokenizer DIR`` (the pods then tokenize with it, for every row of the run):

    python -m bench.replicas --tokenizer ~/.cache/extproc-e2e/model/qwen3-tiny \
        --only "1 replica (today)" --only "1 Envoy, metadata" --only precise \
        --json bench/results/replicas-precise.json --markdown bench/results/replicas-precise.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from prometheus_client import CollectorRegistry

from bench.contenders import precise_config
from extproc.pods import Pod, PodId
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, load_config
from extproc.sim.demo import SIM_ARGS, engine_counters, hit_ratio, make_workload
from extproc.sim.launch import SimPods, spawn_sim_pods
from extproc.wire.one_round import RouteHandler
from extproc.wire.protocol import ATTRIBUTES_KEY, PATH_ATTRIBUTE, REQUEST_ID_ATTRIBUTE
from extproc.wire.record_metadata import carried_record, record_reply
from testkit.kv_events import wait_events_trusted
from testkit.replicas import run_replicas


@dataclass(frozen=True)
class Contender:
    name: str
    replicas: int
    envoys: int
    metadata: bool
    redis: bool
    precise: bool = False  # precise.yaml, the pods' KV events; else the default config


CONTENDERS = (
    Contender("1 replica (today)", 1, 1, False, False),
    Contender("2 replicas, 1 Envoy (today)", 2, 1, False, False),
    Contender("2 replicas, 1 Envoy, metadata", 2, 1, True, False),
    Contender("2 replicas, 1 Envoy, metadata + Redis", 2, 1, True, True),
    Contender("2 replicas, 2 Envoys (today)", 2, 2, False, False),
    Contender("2 replicas, 2 Envoys, metadata + Redis", 2, 2, True, True),
    Contender("3 replicas, 2 Envoys, metadata + Redis", 3, 2, True, True),
    Contender("1 replica, precise", 1, 1, True, False, precise=True),
    Contender("2 replicas, 1 Envoy, metadata, precise", 2, 1, True, False, precise=True),
    Contender("2 replicas, 1 Envoy, metadata + Redis, precise", 2, 1, True, True, precise=True),
)


@dataclass
class Result:
    contender: str
    seed: int
    requests: int
    ok: int
    recorded: int
    recorded_from_metadata: int
    unknown_request: int
    hit_ratio: float
    pods_per_tenant: float
    seconds: float


def run_contender(
    sim: SimPods,
    c: Contender,
    seed: int,
    workload: list[tuple[str, dict[str, Any]]],
    tokenizer: Path | None = None,
) -> Result:
    for pod in sim.pods:
        sim.reset_cache(pod.name)
    with (
        tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp,
        run_replicas(
            sim.as_pods(),
            num_replicas=c.replicas,
            num_envoys=c.envoys,
            redis=c.redis,
            record_metadata=c.metadata,
            config=precise_config(sim.model, tokenizer, 16, Path(tmp) / "precise.yaml")
            if c.precise and tokenizer
            else None,  # the default
            extproc_args=["--kv-events-topology", "connect"] if c.precise else [],
        ) as stack,
    ):
        if c.precise:  # every replica hears every pod before the workload starts
            metrics = [r.metrics_text for r in stack.replicas]
            wait_events_trusted(sim.as_pods(), sim.reset_cache, metrics)
        before = engine_counters(sim)
        urls = stack.urls
        pods_of: dict[str, set[str]] = defaultdict(set)
        statuses: list[int] = []
        started = time.monotonic()

        def send(i: int, client: httpx.Client) -> None:
            tenant, body = workload[i]
            resp = client.post(f"{urls[i % len(urls)]}/v1/chat/completions", json=body)
            statuses.append(resp.status_code)
            pods_of[tenant].add(resp.headers.get("x-sim-pod", "?"))

        with httpx.Client(timeout=30) as client, ThreadPoolExecutor(8) as pool:
            for future in [pool.submit(send, i, client) for i in range(len(workload))]:
                future.result()
        seconds = time.monotonic() - started
        time.sleep(0.5)  # the last access-log batches and stream entries

        def total(outcome: str) -> int:
            return int(stack.total("extproc_completions_total", f'outcome="{outcome}"'))

        return Result(
            c.name,
            seed,
            len(workload),
            sum(s == 200 for s in statuses),
            total("recorded"),
            total("recorded_from_metadata"),
            total("unknown_request"),
            round(hit_ratio(sim, before), 3),
            round(statistics.mean(len(p) for p in pods_of.values()), 2),
            round(seconds, 1),
        )


# --- what a record costs --------------------------------------------------------------------


def record_cost(prompt_bytes: int, repeat: int = 2000) -> dict[str, float]:
    """Reply bytes added by the record, and microseconds to build it (keys hashed already)
    and to read it back from an access-log entry."""
    pods = [
        Pod(PodId("default", f"pod-{i}"), f"10.0.0.{i}:8000", frozenset({"m"})) for i in range(4)
    ]
    routers = {}
    for carry in (False, True):
        scheduler = build_scheduler(load_config(None), CollectorRegistry())
        routers[carry] = Router(scheduler, pods, registry=CollectorRegistry(), carry_records=carry)
    prompt = ("You are a helpful assistant. " * (prompt_bytes // 29 + 1))[:prompt_bytes]
    message = ep.ProcessingRequest(
        request_body=ep.HttpBody(body=json.dumps({"model": "m", "prompt": prompt}).encode())
    )
    message.request_body.end_of_stream = True
    attributes = message.attributes[ATTRIBUTES_KEY].fields
    attributes[PATH_ATTRIBUTE].string_value = "/v1/completions"
    replies = {}
    for carry, router in routers.items():
        handler = RouteHandler(router)
        attributes[REQUEST_ID_ATTRIBUTE].string_value = "warm"
        reply, _ = handler.process(message)
        assert isinstance(reply, bytes)
        replies[carry] = reply
    router = routers[True]
    decision = router.route("/v1/completions", message.request_body.body, request_id="x")
    assert decision.record is not None
    started = time.perf_counter()
    for _ in range(repeat):
        extra = record_reply(decision, decision.record, router.replica_id)
    build_us = (time.perf_counter() - started) / repeat * 1e6
    parsed = ep.ProcessingResponse.FromString(replies[True])
    metadata = base_pb2.Metadata()
    for namespace, value in parsed.dynamic_metadata.fields.items():
        metadata.filter_metadata[namespace].CopyFrom(value.struct_value)
    started = time.perf_counter()
    for _ in range(repeat):
        carried_record(metadata, router.geometries)
    read_us = (time.perf_counter() - started) / repeat * 1e6
    return {
        "prompt_bytes": prompt_bytes,
        "keys": int(sum(len(k) for k in decision.record.keys.values())),
        "reply_bytes_without": len(replies[False]),
        "reply_bytes_with": len(replies[True]),
        "record_bytes": len(extra),
        "build_us": round(build_us, 1),
        "read_back_us": round(read_us, 1),
    }


def markdown(
    results: Sequence[Result], costs: Sequence[dict[str, float]], tokenizer: Path | None = None
) -> str:
    tokens = (
        f" Prompts tokenized by the pods with `{tokenizer.name}`'s tokenizer and chat template."
        " Rows without 'precise' run the default configuration (estimated-ttft on its"
        " approximate view); 'precise' rows run `extproc/data/precise.yaml`, every replica"
        " connected to every pod's KV events and serving once its views are trusted."
        if tokenizer
        else ""
    )
    lines = [
        "# Several extproc replicas (bench.replicas)",
        "",
        (
            "Simulated pods (4), real Envoys and extprocs, real redis-server; the demo's "
            f"workload ({results[0].requests} chat requests, 8 tenants), 8 at a time, round robin "
            "over the Envoys; caches emptied before each row. Counts summed over the replicas."
            + tokens
        ),
        "",
        (
            "| contender | ok | recorded | from metadata | unknown_request | hit ratio "
            "| pods per tenant | s |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.contender} | {r.ok}/{r.requests} | {r.recorded} | "
            f"{r.recorded_from_metadata} | {r.unknown_request} | {r.hit_ratio:.3f} | "
            f"{r.pods_per_tenant} | {r.seconds} |"
        )
    by_contender: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_contender[r.contender].append(r)
    lines += [
        "",
        "Over the seeds:",
        "",
        "| contender | unknown_request | hit ratio mean (min-max) | pods per tenant mean |",
        "|---|---:|---:|---:|",
    ]
    for name, rows in by_contender.items():
        ratios = [r.hit_ratio for r in rows]
        lines.append(
            f"| {name} | {sum(r.unknown_request for r in rows)} | "
            f"{statistics.mean(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
            f"{statistics.mean(r.pods_per_tenant for r in rows):.2f} |"
        )
    lines += [
        "",
        "## What a record costs per request (extproc.record metadata)",
        "",
        "| prompt | keys | reply bytes without -> with | record bytes | build us | read back us |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for c in costs:
        lines.append(
            f"| {int(c['prompt_bytes']):,} B | {int(c['keys'])} | "
            f"{int(c['reply_bytes_without'])} -> {int(c['reply_bytes_with'])} | "
            f"{int(c['record_bytes'])} | {c['build_us']} | {c['read_back_us']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--seeds", default="7,8,9", help="one run of each contender per seed")
    parser.add_argument("--only", action="append", help="contender names to run (substring)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--tokenizer", type=Path, help="the pods' tokenizer (precise rows)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    contenders = [c for c in CONTENDERS if not args.only or any(o in c.name for o in args.only)]
    if any(c.precise for c in contenders) and not args.tokenizer:
        parser.error("the precise rows need --tokenizer DIR")
    pod_args = [*SIM_ARGS]
    if args.tokenizer:
        pod_args += [
            "--tokenizer",
            str(args.tokenizer),
            "--kv-events-endpoint",
            "tcp://127.0.0.1:*",
        ]
    results = []
    with spawn_sim_pods(4, args=pod_args) as sim:
        for seed in seeds:
            workload = make_workload(args.requests, seed)
            for contender in contenders:
                result = run_contender(sim, contender, seed, workload, args.tokenizer)
                print(result, flush=True)
                results.append(result)
    costs = [record_cost(n) for n in (1_000, 8_000, 220_000)]
    text = markdown(results, costs, args.tokenizer)
    print(text)
    if args.json:
        args.json.write_text(
            json.dumps({"results": [asdict(r) for r in results], "costs": costs}, indent=2)
        )
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
