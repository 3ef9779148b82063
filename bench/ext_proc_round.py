"""How long Envoy's ext_proc round takes for the largest bodies extproc accepts: the
figure Envoy's ``message_timeout`` (default ``DEFAULT_MESSAGE_TIMEOUT_S``) must stay above.

Envoy measures it itself: the route adds ``%COMMON_DURATION(DS_RX_END:US_TX_BEG:ms)%``
(whole request body received -> first byte to the pod, i.e. sending the body to extproc,
routing it and the reply) to each answer. Two bodies just under the body limit: one long
prompt, and chat messages of a few bytes each (the costliest to parse), sent 1, 4 and 8
at a time through real Envoy and extproc to simulated pods, with a message timeout long
enough not to cut them. The pods answer 400 (over the model's context): routing is done.

    python -m bench.ext_proc_round [--rounds 3] [--concurrency 1,4,8]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson

from extproc.request.parse import DEFAULT_MAX_BODY_BYTES
from extproc.sim.launch import run_stack, spawn_sim_pods

MODEL = "sim-llm"
HEADER = "x-ext-proc-round-ms"
TIMEOUT_S = 120.0  # Envoy's message timeout here: long enough to measure, not cut


def with_round_header(config: dict[str, Any]) -> dict[str, Any]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    for host in hcm["typed_config"]["route_config"]["virtual_hosts"]:
        host["response_headers_to_add"] = [
            {
                "header": {"key": HEADER, "value": "%COMMON_DURATION(DS_RX_END:US_TX_BEG:ms)%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ]
    return config


def largest_bodies(limit: int = DEFAULT_MAX_BODY_BYTES) -> dict[str, tuple[str, bytes]]:
    """Name -> (path, body), each body just under ``limit`` bytes."""
    prompt = orjson.dumps({"model": MODEL, "prompt": "x" * (limit - 200), "max_tokens": 1})
    message = {"role": "user", "content": "hi"}
    count = limit // len(orjson.dumps(message))
    while len(chat := orjson.dumps({"model": MODEL, "messages": [message] * count})) >= limit:
        count -= 1000
    return {
        "16 MiB prompt": ("/v1/completions", prompt),
        f"{count:,} chat messages": ("/v1/chat/completions", chat),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ext_proc_round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,4,8", help="bodies sent at once")
    args = p.parse_args(argv)
    levels = [int(n) for n in args.concurrency.split(",")]
    with (
        spawn_sim_pods(4, args=["--model", MODEL]) as sim,
        run_stack(
            sim.as_pods(), message_timeout_s=TIMEOUT_S, envoy_transform=with_round_header
        ) as stack,
        httpx.Client(base_url=stack.url, timeout=TIMEOUT_S * 2) as client,
    ):
        print("| body | bytes | at once | median ms | max ms | answers |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, (path, body) in largest_bodies().items():

            def send(_: int, path: str = path, body: bytes = body) -> tuple[int, float]:
                resp = client.post(path, content=body, headers={"content-type": "application/json"})
                return resp.status_code, float(resp.headers.get(HEADER, "nan"))

            for level in levels:
                results: list[tuple[int, float]] = []
                for _ in range(args.rounds):
                    with ThreadPoolExecutor(level) as pool:
                        results += pool.map(send, range(level))
                times = [t for _, t in results if not math.isnan(t)]  # NaN: no upstream reached
                statuses = sorted({s for s, _ in results})
                median = f"{statistics.median(times):.0f}" if times else "-"
                top = f"{max(times):.0f}" if times else "-"
                print(f"| {name} | {len(body):,} | {level} | {median} | {top} | {statuses} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
