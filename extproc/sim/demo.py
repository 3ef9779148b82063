"""``extproc demo``: simulated pods, extproc and Envoy on localhost, one workload, a table.

Starts 4 simulated vLLM pods, extproc with the default configuration and a real Envoy
in front, sends a multi-tenant shared-prefix workload (each tenant has a long system
prompt) through Envoy, prints which pod served each tenant and the pods' own prefix-cache
hit ratio, then empties the pods' caches and sends the same workload round robin
straight to the pods for comparison. Everything it starts, it stops.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from extproc.sim.launch import SimPods, run_stack, spawn_sim_pods

TENANTS = ("acme", "globex", "initech", "umbrella", "hooli", "wonka", "stark", "wayne")
# Each pod holds 192 blocks of 16 tokens, about four tenants' system prompts: round robin
# makes every pod hold every tenant, extproc keeps each tenant on few pods.
SIM_ARGS = ["--model", "sim-llm", "--num-gpu-blocks", "192"]


def make_workload(num_requests: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """(tenant, chat body) pairs: a tenant's requests share a ~2.5 KB system prompt."""
    rng = random.Random(seed)
    systems = {
        t: f"You are the support assistant of {t}. "
        + " ".join(f"Policy {i}: {t} customers get answer style {i % 7}." for i in range(45))
        for t in TENANTS
    }
    workload = []
    for i in range(num_requests):
        tenant = rng.choice(TENANTS)
        messages = [
            {"role": "system", "content": systems[tenant]},
            {"role": "user", "content": f"Question {i}: what about order {rng.randrange(10**6)}?"},
        ]
        workload.append((tenant, {"model": "sim-llm", "messages": messages, "max_tokens": 8}))
    return workload


def hit_ratio(sim: SimPods, before: dict[str, dict[str, int]]) -> float:
    hits = queries = 0
    for pod in sim.pods:
        engine = sim.stats(pod.name)["engine"]
        hits += engine["prefix_cache_hits"] - before[pod.name]["prefix_cache_hits"]
        queries += engine["prefix_cache_queries"] - before[pod.name]["prefix_cache_queries"]
    return hits / queries if queries else 0.0


def engine_counters(sim: SimPods) -> dict[str, dict[str, int]]:
    return {p.name: sim.stats(p.name)["engine"] for p in sim.pods}


def send_all(
    urls: Sequence[str], workload: Sequence[tuple[str, dict[str, Any]]], concurrency: int
) -> dict[str, Counter[str]]:
    """Send each request to ``urls[i % len(urls)]``; returns tenant -> pods that served."""
    served: dict[str, Counter[str]] = defaultdict(Counter)
    with httpx.Client(timeout=30) as client:

        def one(item: tuple[int, tuple[str, dict[str, Any]]]) -> tuple[str, str]:
            i, (tenant, body) = item
            resp = client.post(urls[i % len(urls)] + "/v1/chat/completions", json=body)
            resp.raise_for_status()
            return tenant, resp.headers["x-sim-pod"]

        with ThreadPoolExecutor(concurrency) as pool:
            for tenant, pod in pool.map(one, enumerate(workload)):
                served[tenant][pod] += 1
    return served


def print_routing(title: str, served: dict[str, Counter[str]], pods: Sequence[str]) -> None:
    print(f"\n{title}")
    print("  tenant    " + "".join(f"{p:>9}" for p in pods))
    for tenant in TENANTS:
        print(f"  {tenant:<10}" + "".join(f"{served[tenant][p]:>9}" for p in pods))


def run_demo(num_requests: int, concurrency: int, seed: int) -> int:
    workload = make_workload(num_requests, seed)
    print(f"starting 4 simulated vLLM pods, extproc and Envoy; {num_requests} requests")
    with spawn_sim_pods(4, args=SIM_ARGS) as sim:
        pods = sim.as_pods()
        names = [p.name for p in sim.pods]
        with run_stack(pods) as stack:
            before = engine_counters(sim)
            routed = send_all([stack.url], workload, concurrency)
            extproc_ratio = hit_ratio(sim, before)
        for name in names:
            sim.reset_cache(name)
        before = engine_counters(sim)
        round_robin = send_all(sim.urls, workload, concurrency)
        rr_ratio = hit_ratio(sim, before)
    print_routing("through Envoy + extproc (requests per pod):", routed, names)
    print_routing("round robin, same pods, caches emptied first:", round_robin, names)
    print("\npods' prefix-cache hit ratio (cached prompt tokens / prompt tokens):")
    print(f"  extproc      {extproc_ratio:6.1%}")
    print(f"  round robin  {rr_ratio:6.1%}")
    return 0


DESCRIPTION = """\
Try extproc on localhost: start 4 simulated vLLM pods, extproc on them and a real Envoy in
front, send a multi-tenant workload (each tenant has a long system prompt) through Envoy,
and print which pods served each tenant and the pods' prefix-cache hit ratio beside what
round robin gets on the same pods. Everything it starts, it stops.

Most common:
  extproc demo
  extproc demo --requests 500 --concurrency 8

Documentation: the site `make docs` builds from docs/ (docs/getting-started.md; every flag
in docs/reference/cli.md)."""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "demo",
        help="run Envoy + extproc + simulated pods on localhost",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--requests", type=int, default=200, help="requests to send (default: %(default)s)"
    )
    p.add_argument(
        "--concurrency", type=int, default=4, help="client threads (default: %(default)s)"
    )
    p.add_argument(
        "--seed", type=int, default=1, help="the workload's random seed (default: %(default)s)"
    )
    p.set_defaults(func=lambda args: run_demo(args.requests, args.concurrency, args.seed))


if __name__ == "__main__":
    sys.exit(run_demo(200, 4, 1))
