"""Instructions per routed request: extproc under callgrind behind real Envoy, side by side.

Wall-clock CPU per request (``bench.picker``) moves by tens of percent on a shared
2-core machine from one run to the next; the user-space instructions extproc executes
per request do not (``valgrind --tool=callgrind`` counts them, whatever else the machine
is doing). So this is the figure to compare two versions or two configurations by.
Kernel time (socket I/O, wake-ups) is not in it: it measures the work of extproc's own
code and of the libraries it calls (gRPC core, protobuf, NumPy, ...).

Each variant (a scheduler configuration, optionally another checkout of extproc) runs
behind extproc's generated Envoy in front of instant pods (``bench/upstreams.py``):
extproc starts under callgrind with instrumentation off, wrk sends every prefix once
(the warm-up, so the prefix index holds them), then instrumentation is switched on for
one loaded wrk run and the counts are dumped. Reported: instructions per request in all
of extproc's threads and in its busiest one (the gRPC loop), each as a ratio to the
first variant, and the functions with the most instructions of their own.

Pods are not scraped here (``--stale-after-s 0``: readiness from the pods file alone; the
instant pods' gauges are idle anyway), so the counts are the request path's only;
``bench.scrape`` measures scraping. (With scraping on, every measured request of the
1,000-pod runs failed on a loaded machine: under callgrind the first scrapes time out, and
a pod never scraped is not ready.)

    python -m bench.instructions              # default, least-request alone, no routing
    python -m bench.instructions --variant base=default@/tmp/old --variant now=default
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.loadgen import Load, make_workload, run_wrk
from bench.picker import Target, warm_up
from bench.picker_report import machine, publish
from bench.upstreams import start_upstreams
from extproc.pods import Pod
from extproc.sim.launch import run_stack

START_TIMEOUT_S = 240.0  # importing extproc under valgrind is slow
# Under callgrind extproc runs ~50x slower, more still just after instrumentation is
# switched on: Envoy's 1 s default for the body reply would answer some requests 504.
MESSAGE_TIMEOUT_S = 30.0
TRIVIAL = "trivial"  # the config name that runs bench.trivial_picker: the server, no routing
DEFAULT_VARIANTS = (
    "default=default",
    "least-request=bench/configs/least-request.yaml",
    f"no-routing={TRIVIAL}",
)
TOP_FUNCTIONS = 12


@dataclass(frozen=True, slots=True)
class Variant:
    """``NAME=CONFIG[@CHECKOUT]``: a scheduler config ("default": the shipped one;
    "trivial": ``bench.trivial_picker``, the server doing no routing), and the directory
    of the extproc checkout to run (default: this one)."""

    name: str
    config: str
    checkout: Path | None

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, _, rest = text.partition("=")
        config, _, checkout = rest.partition("@")
        if not name or not config:
            raise argparse.ArgumentTypeError(f"expected NAME=CONFIG[@CHECKOUT], got {text!r}")
        return cls(name, config, Path(checkout).resolve() if checkout else None)

    def command(self, out_file: Path) -> list[str]:
        """extproc ``serve`` under callgrind, instrumentation off until switched on."""
        if self.config == TRIVIAL:
            python = [sys.executable, "-m", "bench.trivial_picker"]
        elif self.checkout is None:
            python = [sys.executable, "-m", "extproc"]
        else:  # the other checkout first on the path, its own command line
            boot = (
                f"import sys; sys.path.insert(0, {str(self.checkout)!r}); "
                "from extproc.cli import main; sys.exit(main())"
            )
            python = [sys.executable, "-c", boot]
        return [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
            f"--callgrind-out-file={out_file}", *python,
        ]  # fmt: skip

    def config_path(self) -> Path | None:
        """The ``--config`` to pass (None: the shipped one)."""
        return None if self.config in ("default", TRIVIAL) else Path(self.config).resolve()


def checkout_commit(directory: Path) -> str:
    """The short commit ``directory``'s checkout is at (its path if it is none)."""
    found = subprocess.run(
        ["git", "-C", str(directory), "rev-parse", "--short", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
    )
    return found.stdout.strip() if found.returncode == 0 else str(directory)


def callgrind_control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=120)


def thread_totals(out_file: Path, dump: str) -> dict[Path, int]:
    """Instructions of each thread's file from the dump named ``dump``."""
    totals = {}
    for path in sorted(out_file.parent.glob(out_file.name + ".*")):
        text = path.read_text(errors="replace")
        if f"Trigger: dump {dump}" in text:
            found = re.search(r"^totals: (\d+)", text, re.MULTILINE)
            totals[path] = int(found.group(1)) if found else 0
    return totals


def top_functions(path: Path, count: int) -> list[tuple[int, str]]:
    """The functions with the most instructions of their own in a callgrind file."""
    out = subprocess.run(
        ["callgrind_annotate", str(path)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    return parse_annotate(out)[:count]


def parse_annotate(text: str) -> list[tuple[int, str]]:
    """callgrind_annotate's rows -> (instructions, ``file:function`` without directories)."""
    rows = []
    for line in text.splitlines():
        found = _ANNOTATE_ROW.match(line)
        if found and "PROGRAM TOTALS" not in line:
            rows.append((int(found.group(1).replace(",", "")), found.group(2).rsplit("/", 1)[-1]))
    return rows


_ANNOTATE_ROW = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(.+?)(?: \[.*\])?$")


def measure(
    variant: Variant, pods: list[Pod], prompt_kb: int, load: Load, work_dir: Path
) -> dict[str, Any]:
    """One variant: start, warm up, count one loaded run; the counts per request."""
    log_dir = work_dir / variant.name
    log_dir.mkdir()
    out_file = log_dir / "callgrind.out"
    with run_stack(
        pods,
        config=variant.config_path(),
        extproc_args=["--stale-after-s", "0"],
        extproc_command=variant.command(out_file),
        extproc_start_timeout_s=START_TIMEOUT_S,
        message_timeout_s=MESSAGE_TIMEOUT_S,
    ) as stack:
        workload = make_workload(prompt_kb * 1024, 2 * len(pods), log_dir)
        warm_up(Target(variant.name, stack.url, {}), workload, Load(1, 2, 2))
        pid = str(stack.extproc.pid)  # valgrind's: the tool runs in the same process
        callgrind_control("--instr=on", pid)
        result = run_wrk(stack.url, workload, load)
        callgrind_control("--dump=measured", pid)
        callgrind_control("--instr=off", pid)
    totals = thread_totals(out_file, "measured")
    requests = int(result["requests"])
    if not totals or requests == 0 or result["non_2xx"]:
        raise RuntimeError(f"{variant.name}: no clean measured run: {result}, dumps {totals}")
    busiest = max(totals, key=lambda p: totals[p])
    return {
        "variant": variant.name,
        "config": variant.config,
        "checkout": checkout_commit(variant.checkout or Path.cwd()),
        "requests": requests,
        "rps_under_callgrind": result["rps"],
        "instructions_per_request": round(sum(totals.values()) / requests),
        "busiest_thread_per_request": round(totals[busiest] / requests),
        "threads": len(totals),
        "top_functions": [
            {"instructions_per_request": round(n / requests), "function": name}
            for n, name in top_functions(busiest, TOP_FUNCTIONS)
        ],
    }


def markdown(results: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, Any]) -> str:
    base = results[0]
    lines = [
        "# Instructions per routed request (extproc under callgrind, behind real Envoy)",
        "",
        (
            f"{info['cpu_model']}, {info['cores']} cores; commit {info['git_sha'][:12]}; "
            f"{args.prompt_kb} KB chat prompts, {args.pods} pods, wrk -t1 -c{args.connections} "
            f"-d{args.seconds}s after a warm-up; user-space instructions only (no kernel time)."
        ),
        "",
        (
            "| variant | config | commit | requests | instructions/request | x "
            f"{base['variant']} | busiest thread/request | x {base['variant']} |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['variant']} | {r['config']} | {r['checkout']} | {r['requests']} | "
            f"{r['instructions_per_request']:,} | "
            f"{r['instructions_per_request'] / base['instructions_per_request']:.2f} | "
            f"{r['busiest_thread_per_request']:,} | "
            f"{r['busiest_thread_per_request'] / base['busiest_thread_per_request']:.2f} |"
        )
    for r in results:
        lines += ["", f"## {r['variant']}: busiest thread, instructions of its own per request"]
        lines += ["", "| instructions | function |", "|---:|---|"]
        lines += [
            f"| {f['instructions_per_request']:,} | `{f['function']}` |" for f in r["top_functions"]
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variant",
        action="append",
        type=Variant.parse,
        help="NAME=CONFIG[@CHECKOUT], repeatable; the first is the baseline "
        f"(default: {', '.join(DEFAULT_VARIANTS)})",
    )
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--prompt-kb", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=10, help="the counted wrk run")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--markdown", type=Path, help="also write the tables here")
    args = parser.parse_args()
    variants = args.variant or [Variant.parse(v) for v in DEFAULT_VARIANTS]
    load = Load(1, args.connections, args.seconds)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="extproc-instructions-") as tmp:
        work_dir = Path(tmp)
        upstreams, pods = start_upstreams(args.pods, work_dir)
        try:
            results = []
            for variant in variants:
                results.append(measure(variant, pods, args.prompt_kb, load, work_dir))
                print(json.dumps({k: v for k, v in results[-1].items() if k != "top_functions"}))
        finally:
            upstreams.stop()
    publish(markdown(results, args, machine()), {"results": results}, args.json, args.markdown)
    print(f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
