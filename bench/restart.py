"""The hit ratio after an extproc restart, with and without ``--view-snapshot``, against no
restart (issue 33): simulated pods through Envoy, ``TENANTS`` prefixes warmed ``WARM``
rounds, then extproc stopped by SIGTERM and started again (or not), then the pods' own
prefix-cache hit ratio over the next ``MEASURED`` requests, each for a random tenant.

    python -m bench.restart [--seeds 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from e2e.support import MODEL, PREFIX_CONFIG, body_for, unique_prefix
from extproc.sim.launch import SimPods, run_stack, spawn_sim_pods
from testkit.waiting import wait_until

API = "/v1/completions"
TENANTS, WARM, MEASURED, PODS = 40, 3, 200, 4
KINDS = ("no restart", "restart with the snapshot", "restart, empty")
RECORDED_WAIT_S = 1.0  # the last warm-up answers' access-log records reach extproc


def engine_totals(sim: SimPods) -> tuple[float, float]:
    """The pods' prefix-cache hits and queries so far, in tokens."""
    hits = queries = 0.0
    for pod in sim.pods:
        engine = sim.stats(pod.name)["engine"]
        hits += engine["prefix_cache_hits"]
        queries += engine["prefix_cache_queries"]
    return hits, queries


def hit_ratio_after(kind: str, seed: int) -> float:
    """One run of ``kind`` (``KINDS``): the hit ratio of the measured requests."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp, spawn_sim_pods(PODS, args=["--model", MODEL]) as sim:
        args = ["--drain-s", "2"]
        if kind == KINDS[1]:
            args += ["--view-snapshot", str(Path(tmp) / "view.npz")]
        with (
            run_stack(sim.as_pods(), config=PREFIX_CONFIG, extproc_args=args) as stack,
            httpx.Client(base_url=stack.url, timeout=30) as client,
        ):

            def ask(prefix: str, question: str) -> bool:
                return client.post(API, json=body_for(API, prefix, question)).is_success

            prefixes = [unique_prefix() for _ in range(TENANTS)]
            for round_ in range(WARM):
                for tenant, prefix in enumerate(prefixes):
                    assert ask(prefix, f"warm {round_} {tenant}?")
            time.sleep(RECORDED_WAIT_S)
            if kind != KINDS[0]:
                stack.extproc.stop()
                stack.extproc = stack.start_extproc_again()
                wait_until(lambda: ask("probe ", "up?"), 30, what="extproc serving again")
            hits0, queries0 = engine_totals(sim)
            for i in range(MEASURED):
                assert ask(prefixes[rng.randrange(TENANTS)], f"measured {i}?")
            hits1, queries1 = engine_totals(sim)
    return (hits1 - hits0) / (queries1 - queries0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    ratios = {kind: [hit_ratio_after(kind, seed) for seed in range(args.seeds)] for kind in KINDS}
    baseline = statistics.fmean(ratios[KINDS[0]])
    lines = [
        "# The hit ratio after a restart (`python -m bench.restart`)",
        "",
        (
            f"{PODS} simulated pods through Envoy, {TENANTS} tenants' prefixes warmed {WARM} "
            f"rounds, then the pods' hit ratio over the first {MEASURED} requests after "
            f"extproc was stopped by SIGTERM and started again; {args.seeds} seeds each. "
            f"UTC {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}."
        ),
        "",
        "| case | hit ratio (each seed) | vs no restart |",
        "| --- | --- | ---: |",
    ]
    for kind, values in ratios.items():
        mean = statistics.fmean(values)
        each = " / ".join(f"{v:.3f}" for v in values)
        lines.append(f"| {kind} | {mean:.3f} ({each}) | {mean / baseline:.2f}x |")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "restart.md"
    path.write_text("\n".join(lines) + "\n")
    print(path.read_text())


if __name__ == "__main__":
    main()
