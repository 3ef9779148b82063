"""The hit ratio after an extproc restart in precise mode (issue 33): simulated pods
publishing KV events through Envoy, ``TENANTS`` prefixes warmed ``WARM`` rounds, then
extproc stopped by SIGTERM and started again (or not), then the pods' own prefix-cache
hit ratio over the next ``MEASURED`` requests, each for a random tenant. Cases: no
restart; the snapshot with the precise view seeded; the snapshot as version 1 wrote it
(approximate views only: the precise view starts empty, as before seeding); no snapshot.
Two configurations: the shipped precise.yaml (estimated-ttft reading precise-prefix-cache's
exact counts, its own approximate view otherwise) and precise-prefix-cache alone.

    python -m bench.restart_precise [--seeds 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.contenders import precise_config
from bench.restart import engine_totals
from e2e.support import MODEL
from extproc.sim.launch import run_stack, spawn_sim_pods
from testkit.factories import precise_only_config, write_tokenizer
from testkit.kv_events import wait_events_trusted
from testkit.waiting import wait_until

API = "/v1/completions"
TENANTS, WARM, MEASURED, PODS = 40, 3, 200, 4
PREFIX_WORDS = 96  # six blocks of 16 tokens
WORDS = ("hello", "world", "system", "user", "assistant")  # write_tokenizer's vocabulary
KINDS = ("no restart", "snapshot, precise view seeded", "snapshot, approximate only", "no snapshot")
RECORDED_WAIT_S = 1.0  # the last answers' access-log records and KV events reach extproc


def as_version_1(path: Path) -> None:
    """The file as version 1 wrote it: the precise views left out."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files if not name.startswith("p")}
    header = json.loads(arrays.pop("header").tobytes())
    header["version"] = 1
    del header["precise"]
    buffer = io.BytesIO()
    np.savez(buffer, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)
    path.write_bytes(buffer.getvalue())


def hit_ratio_after(kind: str, config_name: str, seed: int) -> float:
    """One run of ``kind`` (``KINDS``) with a configuration: the measured hit ratio."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = write_tokenizer(Path(tmp) / "tokenizer")
        if config_name == "precise.yaml":
            config = precise_config(MODEL, tokenizer, 16, Path(tmp) / "precise.yaml")
        else:
            config = Path(tmp) / "precise-only.yaml"
            config.write_text(precise_only_config(MODEL, tokenizer))
        snapshot = Path(tmp) / "view.npz"
        args = ["--drain-s", "2", "--kv-events-topology", "connect"]
        if kind != KINDS[3]:
            args += ["--view-snapshot", str(snapshot)]
        sim_args = ["--model", MODEL, "--tokenizer", str(tokenizer),
                    "--kv-events-endpoint", "tcp://127.0.0.1:*"]  # fmt: skip
        with (
            spawn_sim_pods(PODS, args=sim_args) as sim,
            run_stack(sim.as_pods(), config=config, extproc_args=args) as stack,
            httpx.Client(base_url=stack.url, timeout=30) as client,
        ):
            wait_events_trusted(sim.as_pods(), sim.reset_cache, [stack.metrics_text])

            def ask(tenant: int, question: str) -> bool:
                words = random.Random(f"{seed}-{tenant}").choices(WORDS, k=PREFIX_WORDS)
                body = {"model": MODEL, "prompt": " ".join(words) + question, "max_tokens": 2}
                return client.post(API, json=body).is_success

            for round_ in range(WARM):
                for tenant in range(TENANTS):
                    assert ask(tenant, " hello" * (round_ + 1))
            time.sleep(RECORDED_WAIT_S)
            if kind != KINDS[0]:
                stack.extproc.stop()
                if kind == KINDS[2]:
                    as_version_1(snapshot)
                stack.extproc = stack.start_extproc_again()
                probe = {"model": MODEL, "prompt": "up", "max_tokens": 1}
                wait_until(lambda: client.post(API, json=probe).is_success, 30,
                           what="extproc serving again")  # fmt: skip
            hits0, queries0 = engine_totals(sim)
            for i in range(MEASURED):
                assert ask(rng.randrange(TENANTS), " world" * (i % 7 + 1))
            hits1, queries1 = engine_totals(sim)
    return (hits1 - hits0) / (queries1 - queries0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    lines = [
        "# The hit ratio after a restart in precise mode (`python -m bench.restart_precise`)",
        "",
        (
            f"{PODS} simulated pods publishing KV events, through Envoy; {TENANTS} tenants' "
            f"prefixes ({PREFIX_WORDS} tokens) warmed {WARM} rounds, then the pods' hit ratio "
            f"over the first {MEASURED} requests after extproc was stopped by SIGTERM and "
            f"started again; {args.seeds} seeds each. No replay endpoint. "
            f"UTC {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}."
        ),
    ]
    for config_name in ("precise.yaml", "precise-prefix-cache alone"):
        ratios = {
            kind: [hit_ratio_after(kind, config_name, seed) for seed in range(args.seeds)]
            for kind in KINDS
        }
        baseline = statistics.fmean(ratios[KINDS[0]])
        lines += ["", f"## {config_name}", "", "| case | hit ratio (each seed) | vs no restart |",
                  "| --- | --- | ---: |"]  # fmt: skip
        for kind, values in ratios.items():
            mean = statistics.fmean(values)
            each = " / ".join(f"{v:.3f}" for v in values)
            lines.append(f"| {kind} | {mean:.3f} ({each}) | {mean / baseline:.2f}x |")
        print("\n".join(lines[-6:]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "restart-precise.md"
    path.write_text("\n".join(lines) + "\n")
    print(path.read_text())


if __name__ == "__main__":
    main()
