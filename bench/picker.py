"""Envoy + extproc against Envoy alone and sglang-router, same instant pods, same run.

A matrix of prompt sizes (``--prompt-kb``) by pod counts (``--pods``). For each pod count
one set of processes serves every prompt size:

- the pods: one Envoy with a listener per pod, answering instantly (``bench/upstreams.py``),
  so the cost measured is the proxies' and the picker's;
- ``envoy``: Envoy alone, round robin (extproc's bootstrap without ext_proc);
- ``envoy+extproc``: extproc's generated bootstrap and ``extproc serve`` (default scheduler);
- ``sglang-router``: the peer full proxy, ``cache_aware`` (``--no-sglang`` leaves it out).

Each cell: write the workload (``bench/loadgen.py``: ``prompt_kb`` KB chat requests over
``--prefixes-per-pod`` (2) x pods distinct prefixes, chosen at random), warm up (every prefix
sent once through extproc and through sglang-router, so both prefix indexes hold every
prefix, on every pod that served one), then ``--rounds`` rounds, each a loaded run
(wrk ``-t2 -c16``) of every router in turn, then a low-load run (wrk ``-t1 -c1``) of
every router in turn. CPU per request is each process's user+system time over the run
(process and its children) divided by the requests wrk completed.

"Warm" is not "at capacity": extproc's index keeps 50,000 block entries per pod, that is
390 distinct 8 KB prompts (128 blocks each) per pod; filling 1,000 pods would take
390,000 requests. Measured: lookups and records with every prefix in the index, on the
pods extproc chose for them (the report counts those pods).

    python -m bench.picker [--prompt-kb 1,8,220] [--pods 16,1000] [--seconds 5]
        [--low-seconds 3] [--rounds 2] [--json FILE] [--markdown FILE] [--profile FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import pyspy
from bench.contenders import sglang_argv, start_envoy_alone, start_peer
from bench.loadgen import Load, Workload, make_workload, run_wrk
from bench.picker_report import ENVOY, EXTPROC, SGLANG, machine, markdown, medians, ratios
from bench.upstreams import start_upstreams
from e2e.real_vllm.prepare import peer_binary, prepare_peer
from extproc.pods import Pod
from extproc.sim.launch import Stack, free_port, run_stack

WARM_RUN_S = 2  # one warm-up wrk run; runs repeat until every prefix was sent
MAX_WARM_RUNS = 40
# CPU with no requests: background work (extproc scrapes every pod's /metrics). Measured
# after the first sweeps, which scrape every pod at once before the scraper's CPU budget
# spaces the sweeps out (at 1,000 pods the first second alone took 60% of a core), and
# over several sweeps, whose CPU comes in bursts (0-18% a second at 1,000 pods).
IDLE_SETTLE_S = 5.0
IDLE_S = 10.0
SGLANG_START_TIMEOUT_S = 180.0  # it probes every worker before it serves


@dataclass(frozen=True, slots=True)
class Target:
    """A router under test: its URL, the processes charged for its CPU and their idle CPU %."""

    name: str
    url: str
    pids: dict[str, int]  # by role: "envoy", "extproc", "router"
    idle_pct: dict[str, float] = field(default_factory=dict)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            total += cpu_seconds(int(child))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return total + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(target: Target, workload: Workload, load: Load, label: str) -> dict[str, float]:
    """One wrk run against ``target`` with the CPU per request of each of its processes.

    ``ROLE_cpu_us_per_request`` is all the CPU the process used over the run;
    ``ROLE_net_us_per_request`` leaves out what it burns when idle (``Target.idle_pct``).
    """
    before = {role: cpu_seconds(pid) for role, pid in target.pids.items()}
    started = time.monotonic()
    result = run_wrk(target.url, workload, load)
    elapsed_s = time.monotonic() - started
    num_requests = max(result["requests"], 1)
    for role, pid in target.pids.items():
        used_us = (cpu_seconds(pid) - before[role]) * 1e6
        idle_us = target.idle_pct.get(role, 0.0) / 100 * elapsed_s * 1e6
        result[f"{role}_cpu_us_per_request"] = round(used_us / num_requests, 1)
        result[f"{role}_net_us_per_request"] = round((used_us - idle_us) / num_requests, 1)
    print(f"    {label:5s} {target.name:14s} {json.dumps(result)}", flush=True)
    return result


def warm_up(target: Target, workload: Workload, loaded: Load) -> int:
    """Send every prefix once, in order (repeated runs); returns the requests sent."""
    load = Load(loaded.threads, loaded.connections, WARM_RUN_S)
    sent = 0
    for _ in range(MAX_WARM_RUNS):
        if sent >= workload.num_prefixes:
            return sent
        sent += int(run_wrk(target.url, workload, load, mode="warm", offset=sent)["requests"])
    raise TimeoutError(f"{target.name}: {sent} of {workload.num_prefixes} prefixes warmed")


def pods_served(admin_port: int) -> int:
    """Pods of extproc's cluster that answered at least one request (so hold index entries)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/clusters", timeout=10) as r:
        lines = r.read().decode().splitlines()
    # Lines read "extproc_pods::127.0.0.1:PORT::rq_success::COUNT".
    fields = [line.split("::") for line in lines if line.startswith("extproc_pods::")]
    return sum(1 for f in fields if f[2] == "rq_success" and int(f[3]) > 0)


def idle_cpu_pct(pids: dict[str, int], seconds: float = IDLE_S) -> dict[str, float]:
    """Each process's CPU % (of one core) over ``seconds`` without requests."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    return {
        name: round((cpu_seconds(pid) - before[name]) / seconds * 100, 1)
        for name, pid in pids.items()
    }


def with_idle(targets: list[Target], upstreams_pid: int) -> tuple[list[Target], dict[str, float]]:
    """The targets with their processes' idle CPU %, and every such % by "target/role"."""
    pids = {f"{t.name}/{role}": pid for t in targets for role, pid in t.pids.items()}
    time.sleep(IDLE_SETTLE_S)
    idle = idle_cpu_pct({"pods/envoy": upstreams_pid, **pids})
    return [
        replace(t, idle_pct={role: idle[f"{t.name}/{role}"] for role in t.pids}) for t in targets
    ], idle


@contextmanager
def routers(
    pods: list[Pod], log_dir: Path, args: argparse.Namespace
) -> Iterator[tuple[list[Target], Stack]]:
    """Start Envoy alone, Envoy + extproc and (maybe) sglang-router; stop them after."""
    extproc_args = ["--scraper", args.scraper]
    if args.scrape_interval_s:
        extproc_args += ["--scrape-interval-s", str(args.scrape_interval_s)]
    with ExitStack() as stack:
        envoy, envoy_url = start_envoy_alone(pods, log_dir, "envoy-alone")
        stack.callback(envoy.stop)
        ext = stack.enter_context(run_stack(pods, config=args.config, extproc_args=extproc_args))
        targets = [
            Target(ENVOY, envoy_url, {"envoy": envoy.pid}),
            Target(EXTPROC, ext.url, {"envoy": ext.envoy.pid, "extproc": ext.extproc.pid}),
        ]
        if not args.no_sglang:
            port = free_port()
            sglang, url = start_peer(
                SGLANG, sglang_argv(pods, port), port, log_dir, SGLANG_START_TIMEOUT_S
            )
            stack.callback(sglang.stop)
            targets.append(Target(SGLANG, url, {"router": sglang.pid}))
        yield targets, ext


def profile_run(target: Target, workload: Workload, load: Load, out: Path) -> dict[str, Any]:
    """One extra loaded run with py-spy sampling extproc; the run and the top functions."""
    recorder = pyspy.start_recording(target.pids["extproc"], load.seconds, out)
    try:
        result = measure(target, workload, load, "prof")
    finally:
        pyspy.finish_recording(recorder, load.seconds)
    num_samples, entries = pyspy.top_entries(out.read_text())
    return {"run": result, "samples": num_samples, "top": [asdict(e) for e in entries]}


def run_cell(
    targets: list[Target], ext: Stack, workload: Workload, args: argparse.Namespace, name: str
) -> dict[str, Any]:
    """Warm up, then the alternating rounds of loaded and low-load runs, and the medians."""
    loaded = Load(args.threads, args.connections, args.seconds)
    low = Load(1, 1, args.low_seconds)
    warm = {t.name: warm_up(t, workload, loaded) for t in targets if t.name != ENVOY}
    cell: dict[str, Any] = {
        "prompt_kb": workload.prompt_bytes // 1024,
        "num_prefixes": workload.num_prefixes,
        "warm_requests": warm,
        "pods_with_entries": pods_served(ext.admin_port),
        "runs": {t.name: {"loaded": [], "low": []} for t in targets},
    }
    for r in range(args.rounds):
        print(f"  round {r + 1}/{args.rounds}", flush=True)
        for kind, load in (("loaded", loaded), ("low", low)):
            for t in targets:
                cell["runs"][t.name][kind].append(measure(t, workload, load, kind))
    cell["summary"] = {
        name: {kind: medians(runs) for kind, runs in by_kind.items()}
        for name, by_kind in cell["runs"].items()
    }
    cell["ratios"] = ratios(cell["summary"])
    if args.profile:  # py-spy's collapsed stacks stay beside the profile, for flame graphs
        out = args.profile.with_name(f"{args.profile.stem}-{name}.collapsed")
        ext_target = next(t for t in targets if t.name == EXTPROC)
        cell["profile"] = profile_run(ext_target, workload, loaded, out)
    return cell


def run_pods(num_pods: int, args: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    """Every prompt size on one set of processes in front of ``num_pods`` pods."""
    cells = []
    with ExitStack() as stack:
        upstreams, pods = start_upstreams(num_pods, log_dir)
        stack.callback(upstreams.stop)
        started, ext = stack.enter_context(routers(pods, log_dir, args))
        targets, idle = with_idle(started, upstreams.pid)
        for kb in args.prompt_kb:
            print(f"{kb} KB prompts, {num_pods} pods", flush=True)
            workload = make_workload(kb * 1024, args.prefixes_per_pod * num_pods, log_dir)
            cell = run_cell(targets, ext, workload, args, f"{kb}kb-{num_pods}pods")
            cells.append({"pods": num_pods, "idle_cpu_pct": idle, **cell})
    return cells


def profile_text(cells: list[dict[str, Any]]) -> str:
    """The py-spy tables of every cell, as Markdown."""
    parts = ["## extproc under load, py-spy (self and total %)", ""]
    for cell in cells:
        p = cell["profile"]
        title = f"{cell['prompt_kb']} KB prompts, {cell['pods']} pods ({p['run']['rps']:.0f} req/s)"
        entries = [pyspy.Entry(**e) for e in p["top"]]
        parts.append(pyspy.format_entries(title, p["samples"], entries))
    return "\n".join(parts)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-kb", type=_int_list, default=[1, 8, 220], help="e.g. 1,8,220")
    parser.add_argument("--pods", type=_int_list, default=[16, 1000], help="e.g. 16,1000")
    parser.add_argument("--prefixes-per-pod", type=int, default=2, help="distinct prefixes")
    parser.add_argument("--seconds", type=int, default=5, help="each loaded run")
    parser.add_argument("--low-seconds", type=int, default=3, help="each low-load run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="wrk threads, loaded runs")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections, loaded")
    parser.add_argument("--no-sglang", action="store_true", help="leave sglang-router out")
    parser.add_argument("--config", type=Path, help="extproc scheduler config (default: shipped)")
    parser.add_argument(
        "--scrape-interval-s", type=float, help="extproc's pod scrape interval (default: its own)"
    )
    parser.add_argument(
        "--scraper", choices=("process", "thread"), default="process", help="extproc's --scraper"
    )
    parser.add_argument("--json", type=Path, help="write config, machine, runs, medians here")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    parser.add_argument("--profile", type=Path, help="py-spy extproc in one extra run a cell")
    return parser.parse_args(argv)


def check_tools(args: argparse.Namespace) -> None:
    if not shutil.which("wrk"):
        sys.exit("wrk not found: apt-get install wrk")
    if args.profile:
        pyspy.py_spy()
    if not args.no_sglang and not peer_binary(SGLANG).exists():
        prepare_peer(SGLANG)  # its own venv under ~/.cache/extproc-e2e, about a minute


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_tools(args)
    result: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v
                                         for k, v in vars(args).items()},
                              "machine": machine(), "cells": []}  # fmt: skip
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-picker-") as tmp:
        for num_pods in args.pods:
            result["cells"] += run_pods(num_pods, args, Path(tmp))
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    report = markdown(result)
    print("\n" + report)
    if args.markdown:
        args.markdown.write_text(report)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.profile:
        text = profile_text(result["cells"])
        args.profile.write_text(text)
        print(text)


if __name__ == "__main__":
    main()
