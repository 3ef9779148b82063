"""Per-request scheduling cost against the number of pods: 16, 256 and 1,000 side by side.

One request is ``Router.route`` + ``Router.complete`` (parse, render, hash, filter, score,
rank, then record the prompt for the pod that served it) with the default scheduler
(``extproc/data/config.yaml``), an 8 KB chat prompt, and every pod's prefix index full
(``--entries`` per pod, the plugin's ``maxHashCacheSize`` set to the same number so each
record evicts). Pods carry varied scraped metrics (a few have a full queue and are
filtered out, some have no latency data). The sizes run in interleaved rounds in one
process; the report is the median per-request time of each size and the median over
rounds of each round's ratio to the 16-pod run (robust to load from other processes). A second pass publishes a new snapshot (every pod's metrics changed) every
``--churn`` requests, as the scraper does each interval, and reports the same figures
with the snapshot's cost spread over its requests. ``--profile`` adds the top cProfile
entries at the largest size.

    python -m bench.scoring                        # 16, 256, 1,000 pods
    python -m bench.scoring --quick                # fewer rounds, for a smoke run
    python -m bench.scoring --profile --json out.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from bench.prefix import BLOCKS, chat_body_8kb
from extproc.pods import Pod, PodId, PodMetrics
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, default_config_text, parse_config
from extproc.scheduling.inflight import InFlight

PATH = "/v1/chat/completions"
NUM_CONVERSATIONS = 32  # distinct prompts sent in turn, all sharing a ~3 KB system prompt


def make_pods(num_pods: int, seed: int) -> list[Pod]:
    """Ready pods serving model "m" with seeded, varied metrics."""
    rng = random.Random(seed)
    pods = []
    for i in range(num_pods):
        has_latency = rng.random() < 0.8
        metrics = PodMetrics(
            waiting=rng.choice([0, 0, 0, 1, 2, 3, 5, 12]),  # 12 >= maxWaitingRequests
            running=rng.randrange(0, 24),
            kv_usage=rng.random(),
            ttft_s=rng.uniform(0.02, 0.8) if has_latency else None,
            itl_s=rng.uniform(0.005, 0.05) if has_latency else None,
        )
        pods.append(
            Pod(
                id=PodId("bench", f"pod-{i}"),
                address=f"10.0.{i // 250}.{i % 250}:8000",
                models=frozenset({"m"}),
                metrics=metrics,
            )
        )
    return pods


@dataclass
class Setup:
    num_pods: int
    router: Router
    bodies: list[bytes]
    snapshots: list[list[Pod]]  # published in turn with ``churn``
    churn: int = 0  # publish a new snapshot every this many requests; 0: never
    next_id: int = 0

    def one_request(self) -> None:
        n = self.next_id
        self.next_id += 1
        if self.churn and n % self.churn == 0:
            self.router.set_pods(self.snapshots[(n // self.churn) % len(self.snapshots)])
        request_id = f"r{n}"
        decision = self.router.route(PATH, self.bodies[n % len(self.bodies)], request_id=request_id)
        self.router.complete(request_id, decision.pods[0].address, True)

    def run(self, num_requests: int) -> float:
        """Per-request microseconds over ``num_requests`` requests."""
        t0 = time.perf_counter_ns()
        for _ in range(num_requests):
            self.one_request()
        return (time.perf_counter_ns() - t0) / 1000 / num_requests


def make_setup(num_pods: int, entries_per_pod: int) -> Setup:
    text = default_config_text().replace(
        "maxHashCacheSize: 50000", f"maxHashCacheSize: {entries_per_pod}"
    )
    assert f"maxHashCacheSize: {entries_per_pod}" in text
    in_flight = InFlight()
    registry = CollectorRegistry()
    scheduler = build_scheduler(parse_config(text, "bench"), registry, in_flight)
    pods = make_pods(num_pods, seed=num_pods)
    router = Router(scheduler, pods, in_flight=in_flight, registry=registry)
    (prefix,) = (p for p in (getattr(s.scorer, "index", None) for s in scheduler.scorers) if p)
    rng = random.Random(num_pods)
    for pod in pods:  # fill every pod's LRU to capacity with random prompts
        for _ in range(-(-entries_per_pod // BLOCKS)):
            prefix.record([rng.getrandbits(64) for _ in range(BLOCKS)], pod.id)
    assert prefix.num_entries == num_pods * entries_per_pod, prefix.num_entries
    bodies = [chat_body_8kb(seed) for seed in range(NUM_CONVERSATIONS)]
    snapshots = [make_pods(num_pods, seed=num_pods + k) for k in range(4)]
    setup = Setup(num_pods, router, bodies, snapshots)
    setup.run(2 * NUM_CONVERSATIONS)  # warm up: every conversation recorded somewhere
    return setup


def measure(setups: list[Setup], rounds: int, num_requests: int) -> dict[int, list[float]]:
    """Per-request microseconds of each setup, one sample a round, sizes interleaved."""
    samples: dict[int, list[float]] = {s.num_pods: [] for s in setups}
    for _ in range(rounds):
        for setup in setups:
            samples[setup.num_pods].append(setup.run(num_requests))
    return samples


def summarize(samples: dict[int, list[float]], base: int) -> dict[str, dict[int, Any]]:
    """Medians, ranges, and the median over rounds of each round's ratio to ``base``
    (a round's sizes run back to back, so its ratio is the least disturbed by load)."""
    return {
        "median_us": {n: round(statistics.median(s), 1) for n, s in samples.items()},
        "range_us": {n: (round(min(s), 1), round(max(s), 1)) for n, s in samples.items()},
        "ratio": {
            n: round(statistics.median(x / b for x, b in zip(s, samples[base], strict=True)), 2)
            for n, s in samples.items()
        },
    }


def set_pods_us(setup: Setup, repeat: int) -> float:
    """Median cost of publishing a new snapshot (every pod's metrics changed)."""
    samples = []
    for i in range(repeat):
        pods = make_pods(setup.num_pods, seed=1000 + i)
        t0 = time.perf_counter_ns()
        setup.router.set_pods(pods)
        samples.append((time.perf_counter_ns() - t0) / 1000)
    setup.router.set_pods(make_pods(setup.num_pods, seed=setup.num_pods))
    return statistics.median(samples)


def profile(setup: Setup, num_requests: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    setup.run(num_requests)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", default="16,256,1000", help="comma-separated pod counts")
    parser.add_argument("--entries", type=int, default=4096, help="index entries per pod")
    parser.add_argument("--requests", type=int, default=100, help="requests per size a round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--churn", type=int, default=50, help="requests per snapshot, pass 2")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 100 requests")
    parser.add_argument("--profile", action="store_true", help="cProfile the largest size")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests = 3, 100
    sizes = [int(n) for n in args.pods.split(",")]
    setups = [make_setup(n, args.entries) for n in sizes]
    gc.collect()
    steady = summarize(measure(setups, args.rounds, args.requests), sizes[0])
    for setup in setups:
        setup.churn = args.churn
    churn = summarize(measure(setups, args.rounds, args.requests), sizes[0])
    for setup in setups:
        setup.churn = 0
    snapshot = {s.num_pods: round(set_pods_us(s, 5), 1) for s in setups}
    results = {
        "config": {
            "entries_per_pod": args.entries,
            "requests_per_round": args.requests,
            "rounds": args.rounds,
            "churn": args.churn,
            "python": sys.version.split()[0],
            "git": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip(),
        },
        "steady": steady,
        "with_churn": churn,
        "set_pods_us": snapshot,
    }
    print(
        f"route + complete, default scheduler, 8 KB chat prompt, {args.entries} entries per pod; "
        f"{args.rounds} rounds x {args.requests} requests, sizes interleaved; "
        f"us/request median [min-max]; ratio: median of the rounds' ratios to {sizes[0]} pods"
    )
    for title, summary in (("steady", steady), (f"new snapshot every {args.churn}", churn)):
        print(f"{title}:")
        for n in sizes:
            lo, hi = summary["range_us"][n]
            print(
                f"  {n:5d} pods  {summary['median_us'][n]:8.1f} us [{lo:.0f}-{hi:.0f}]"
                f"  ratio {summary['ratio'][n]:5.2f}  set_pods {snapshot[n]:.0f} us"
            )
    if args.profile:
        print(f"\nprofile at {sizes[-1]} pods, {args.requests} requests:")
        print(profile(setups[-1], args.requests, 20))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
