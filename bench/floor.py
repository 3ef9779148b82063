"""The floor under any picker on extproc's server: Envoy alone, Envoy + a picker that does
no work, Envoy + extproc, side by side in one run.

The middle one is ``bench.trivial_picker``: extproc's own process, gRPC loop, protobuf
messages and Envoy config, answering every body with a fixed route and ignoring the
access log. What it costs (Envoy's extra CPU, the server's CPU, the added latency) no
routing logic on this server can go below; the gap between it and extproc is what the
routing costs. Pods, workload and CPU accounting are ``bench.picker``'s: instant pods,
chat requests over 2 prefixes per pod, wrk ``-t2 -c16`` loaded and ``-t1 -c1`` low-load
runs, alternating, medians of ``--rounds``.

``--variants public,tls,mtls`` adds extproc on grpcio's public server
(``--grpc-server public``), over TLS (``--grpc-tls files``, Envoy verifying it) and over
mutual TLS, in the same run.

    python -m bench.floor [--prompt-kb 8,220] [--pods 16] [--rounds 3] [--variants ...]
        [--markdown FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.contenders import start_envoy_alone
from bench.loadgen import Load, make_workload
from bench.picker import Target, measure, warm_up
from bench.picker_report import ENVOY, EXTPROC, machine, medians, publish
from bench.upstreams import start_upstreams
from extproc.sim.launch import run_stack
from tests.tls_certs import CertAuthority

TRIVIAL = "envoy+trivial-picker"
TRIVIAL_COMMAND = (sys.executable, "-m", "bench.trivial_picker")
VARIANTS = ("public", "tls", "mtls")


def variant_stack_args(variant: str, work_dir: Path) -> dict[str, Any]:
    """``run_stack`` arguments of extproc on another server or transport."""
    if variant == "public":
        return {"extproc_args": ["--grpc-server", "public"]}
    ca = CertAuthority(work_dir, f"bench-{variant}")
    server = ca.issue(f"extproc-{variant}")
    extproc_args = ["--grpc-tls", "files" if variant == "tls" else "mtls"]
    extproc_args += ["--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key)]
    envoy: dict[str, Any] = {"extproc_tls": True, "extproc_ca_file": str(ca.path)}
    if variant == "mtls":
        extproc_args += ["--tls-client-ca-file", str(ca.path)]
        client = ca.issue(f"envoy-{variant}", client=True)
        envoy |= {
            "extproc_client_cert_file": str(client.cert),
            "extproc_client_key_file": str(client.key),
        }
    return {"extproc_args": extproc_args, "envoy_options": envoy}


def run(args: argparse.Namespace, work_dir: Path) -> list[dict[str, Any]]:
    """Every prompt size against the three targets; the medians of each."""
    rows = []
    with ExitStack() as stack:
        upstreams, pods = start_upstreams(args.pods, work_dir)
        stack.callback(upstreams.stop)
        envoy, envoy_url = start_envoy_alone(pods, work_dir, "envoy-alone")
        stack.callback(envoy.stop)
        trivial = stack.enter_context(run_stack(pods, extproc_command=TRIVIAL_COMMAND))
        full = stack.enter_context(run_stack(pods))
        targets = [
            Target(ENVOY, envoy_url, {"envoy": envoy.pid}),
            Target(
                TRIVIAL, trivial.url, {"envoy": trivial.envoy.pid, "extproc": trivial.extproc.pid}
            ),
            Target(EXTPROC, full.url, {"envoy": full.envoy.pid, "extproc": full.extproc.pid}),
        ]
        for variant in args.variants:
            extra = stack.enter_context(run_stack(pods, **variant_stack_args(variant, work_dir)))
            pids = {"envoy": extra.envoy.pid, "extproc": extra.extproc.pid}
            targets.append(Target(f"{EXTPROC} ({variant})", extra.url, pids))
        loaded, low = Load(2, 16, args.seconds), Load(1, 1, args.low_seconds)
        for kb in args.prompt_kb:
            print(f"{kb} KB prompts, {args.pods} pods", flush=True)
            workload = make_workload(kb * 1024, 2 * args.pods, work_dir)
            for extproc_target in targets[2:]:
                warm_up(extproc_target, workload, loaded)
            runs: dict[str, dict[str, list[dict[str, float]]]] = {
                t.name: {"loaded": [], "low": []} for t in targets
            }
            for _ in range(args.rounds):
                for kind, load in (("loaded", loaded), ("low", low)):
                    for t in targets:
                        runs[t.name][kind].append(measure(t, workload, load, kind))
            for t in targets:
                rows.append(
                    {
                        "prompt_kb": kb,
                        "router": t.name,
                        "loaded": medians(runs[t.name]["loaded"]),
                        "low": medians(runs[t.name]["low"]),
                    }
                )
    return rows


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, Any]) -> str:
    lines = [
        "# The floor under a picker on extproc's server (bench.floor)",
        "",
        (
            f"{info['cpu_model']}, {info['cores']} cores; commit {info['git_sha'][:12]}; "
            f"{args.pods} pods; loaded wrk -t2 -c16 -d{args.seconds}s, low load wrk -t1 -c1 "
            f"-d{args.low_seconds}s; medians of {args.rounds} alternating rounds; "
            f"load average {info.get('load_average', 'not taken')} at the end (anything "
            "above 2 on these 2 cores shares them with other work)."
        ),
        "",
        "| prompt | router | req/s | x envoy | p50 low load ms | added ms | "
        + "envoy us/req | extproc us/req |",
        "|---|---|---|---|---|---|---|---|",
    ]
    alone: dict[int, dict[str, Any]] = {r["prompt_kb"]: r for r in rows if r["router"] == ENVOY}
    for r in rows:
        base = alone[r["prompt_kb"]]
        loaded, low = r["loaded"], r["low"]
        extproc_us = loaded.get("extproc_cpu_us_per_request")
        lines.append(
            f"| {r['prompt_kb']} KB | {r['router']} | {loaded['rps']:.0f} | "
            f"{loaded['rps'] / base['loaded']['rps']:.2f} | {low['p50_ms']:.2f} | "
            f"{low['p50_ms'] - base['low']['p50_ms']:+.2f} | "
            f"{loaded['envoy_cpu_us_per_request']:.0f} | "
            f"{'' if extproc_us is None else f'{extproc_us:.0f}'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--prompt-kb", type=lambda t: [int(x) for x in t.split(",")], default=[8, 220]
    )
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=4, help="each loaded run")
    parser.add_argument("--low-seconds", type=int, default=3, help="each low-load run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--variants",
        type=lambda t: [v for v in t.split(",") if v],
        default=[],
        help=f"extra extproc targets, comma-separated, of {', '.join(VARIANTS)}",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown --variants {', '.join(sorted(unknown))}: choose of {VARIANTS}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="extproc-floor-") as tmp:
        rows = run(args, Path(tmp))
    info = {**machine(), "load_average": f"{os.getloadavg()[0]:.1f}"}
    publish(markdown(rows, args, info), {"rows": rows}, args.json, args.markdown)
    print(f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
