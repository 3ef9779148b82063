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

``--variants bare`` adds extproc without its per-request observers (``--request-metrics
off``): what the observability on by default costs is the default's CPU over it, taken
round by round (the two measured one after the other share the machine's load) and the
median of those ratios reported.

``--variants precise --model-dir DIR`` adds extproc with precise-prefix-cache
(``extproc/data/precise.yaml``, the tokenizer in DIR for the pods' model) and compares it
with extproc's approximate default: with a warm memo (the usual workload, every tenant's
prompt tokenized in the warm-up) and with a cold one (tenants drawn from a million, so
each prompt is new and tokenized whole), each memo's rounds in turn, the two extprocs
alternating.

``--cold`` runs every router again on a cold memo (the tenants drawn from a million: each
prompt's start is new, as each turn of a chat is, so extproc hashes every block of it)
and reports those rows in a table of their own.

    python -m bench.floor [--prompt-kb 8,220] [--pods 16] [--rounds 3] [--variants ...]
        [--model-dir DIR] [--cold] [--json FILE] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from bench.contenders import start_envoy_alone
from bench.loadgen import Load, Workload, make_workload
from bench.picker import Target, measure, warm_up
from bench.picker_report import ENVOY, EXTPROC, machine, medians, publish
from bench.upstreams import MODEL, start_upstreams
from extproc.scheduling.config import named_config_text
from extproc.sim.launch import free_port, run_stack
from testkit.tls_certs import CertAuthority

TRIVIAL = "envoy+trivial-picker"
TRIVIAL_COMMAND = (sys.executable, "-m", "bench.trivial_picker")
VARIANTS = ("public", "tls", "mtls", "precise", "bare")
PRECISE = f"{EXTPROC} (precise)"
BARE = f"{EXTPROC} (bare)"
# Tenants of the cold-memo workload: loadgen's 6-digit number. Drawn at random, a run of
# n requests repeats one about n^2 / 2e6 times: 2% of the 40,000 of the busiest run.
COLD_TENANTS = 1_000_000
SEGMENTS = "extproc_precise_prefix_segments_total"


def precise_config(model_dir: Path, work_dir: Path) -> Path:
    """The shipped precise configuration with ``model_dir``'s tokenizer for the pods' model."""
    doc = yaml.safe_load(named_config_text("precise"))
    for entry in doc["scheduler"]["pluginConfig"]:
        if entry["name"] == "precise-prefix-cache":
            entry["args"]["models"] = {MODEL: str(model_dir)}
    path = work_dir / "precise.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def variant_stack_args(variant: str, work_dir: Path, model_dir: Path | None) -> dict[str, Any]:
    """``run_stack`` arguments of extproc on another server, transport or configuration."""
    if variant == "precise":
        if model_dir is None:
            raise ValueError("--variants precise needs --model-dir")
        # Its KV events subscriber binds a port nobody publishes to: the instant pods have
        # no cache, so every pod scores 0 and the cost measured is the tokenizing's.
        events = f"tcp://127.0.0.1:{free_port()}"
        return {
            "config": precise_config(model_dir, work_dir),
            "extproc_args": ["--kv-events-topology", "bind", "--kv-events-bind", events],
        }
    if variant == "public":
        return {"extproc_args": ["--grpc-server", "public"]}
    if variant == "bare":
        return {"extproc_args": ["--request-metrics", "off"]}
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
    """Every prompt size against the targets; the medians of each (rows of the precise
    comparison's cold memo say ``"memo": "cold"``)."""
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
        metrics_ports: dict[str, int] = {}
        for variant in args.variants:
            extra = stack.enter_context(
                run_stack(pods, **variant_stack_args(variant, work_dir, args.model_dir))
            )
            pids = {"envoy": extra.envoy.pid, "extproc": extra.extproc.pid}
            name = PRECISE if variant == "precise" else f"{EXTPROC} ({variant})"
            targets.append(Target(name, extra.url, pids))
            metrics_ports[name] = extra.metrics_port
        for kb in args.prompt_kb:
            print(f"{kb} KB prompts, {args.pods} pods", flush=True)
            workload = make_workload(kb * 1024, 2 * args.pods, work_dir)
            for extproc_target in targets[2:]:
                warm_up(extproc_target, workload, loaded(args))
            rows += rounds(targets, workload, args, kb, "warm", metrics_ports)
            if args.cold or PRECISE in metrics_ports:
                cold = make_workload(kb * 1024, COLD_TENANTS, work_dir)
                pair = [t for t in targets if args.cold or t.name in (EXTPROC, PRECISE)]
                rows += rounds(pair, cold, args, kb, "cold", metrics_ports)
    return rows


def loaded(args: argparse.Namespace) -> Load:
    return Load(2, 16, args.seconds)


def rounds(
    targets: list[Target],
    workload: Workload,
    args: argparse.Namespace,
    kb: int,
    memo: str,
    metrics_ports: dict[str, int],
) -> list[dict[str, Any]]:
    """``args.rounds`` alternating rounds (loaded, then low load, every target in turn);
    a row of medians per target, with the memo's hit ratio for precise-prefix-cache."""
    low = Load(1, 1, args.low_seconds)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        t.name: {"loaded": [], "low": []} for t in targets
    }
    before = {name: segments(port) for name, port in metrics_ports.items()}
    for _ in range(args.rounds):
        for kind, load in (("loaded", loaded(args)), ("low", low)):
            for t in targets:
                runs[t.name][kind].append(measure(t, workload, load, kind))
    rows = []
    for t in targets:
        row = {"prompt_kb": kb, "router": t.name, "memo": memo,
               "loaded": medians(runs[t.name]["loaded"]), "low": medians(runs[t.name]["low"])}  # fmt: skip
        if t.name == BARE:
            row["default_cpu_ratios"] = paired_ratios(runs[EXTPROC]["loaded"], runs[BARE]["loaded"])
        if t.name in before:
            hits, misses = (a - b for a, b in zip(segments(metrics_ports[t.name]), before[t.name]))
            row["memo_hit_ratio"] = round(hits / max(hits + misses, 1), 3)
        rows.append(row)
    return rows


def paired_ratios(default: list[dict[str, float]], bare: list[dict[str, float]]) -> list[float]:
    """extproc's CPU per request, the default's over the bare one's, round by round."""
    key = "extproc_cpu_us_per_request"
    return [round(d[key] / b[key], 4) for d, b in zip(default, bare, strict=True)]


def segments(metrics_port: int) -> tuple[float, float]:
    """precise-prefix-cache's segments found in its memo and tokenized, so far."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as page:
        lines = page.read().decode().splitlines()
    counts = {"hit": 0.0, "miss": 0.0}
    for line in lines:
        if line.startswith(SEGMENTS + "{"):
            for result in counts:
                if f'result="{result}"' in line:
                    counts[result] += float(line.rsplit(" ", 1)[1])
    return counts["hit"], counts["miss"]


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
    ]
    lines += router_table(rows, "warm")
    if any(r.get("memo") == "cold" and r["router"] == ENVOY for r in rows):
        lines += [
            "",
            "## Cold memo: every prompt's start new",
            "",
            (
                "The same routers with tenants drawn from a million (`--cold`): each "
                "request's prompt differs from the start, as each turn of a chat does, so no "
                "memo holds its block hashes."
            ),
            "",
        ]
        lines += router_table(rows, "cold")
    if any(r["router"] == PRECISE for r in rows):
        lines += precise_markdown(rows)
    if any(r["router"] == BARE for r in rows):
        lines += bare_markdown(rows)
    return "\n".join(lines) + "\n"


def router_table(rows: list[dict[str, Any]], memo: str) -> list[str]:
    """Every router's row of one memo state; "x do-nothing": extproc's CPU per request
    over the do-nothing picker's (issue 31's ratio)."""
    lines = [
        "| prompt | router | req/s | x envoy | p50 low load ms | added ms | "
        + "envoy us/req | extproc us/req | x do-nothing |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    mine = [r for r in rows if r.get("memo", "warm") == memo]
    alone = {r["prompt_kb"]: r for r in mine if r["router"] == ENVOY}
    trivial = {r["prompt_kb"]: r for r in mine if r["router"] == TRIVIAL}
    for r in mine:
        base = alone[r["prompt_kb"]]
        loaded, low = r["loaded"], r["low"]
        extproc_us = loaded.get("extproc_cpu_us_per_request")
        floor_us = (
            trivial.get(r["prompt_kb"], {}).get("loaded", {}).get("extproc_cpu_us_per_request")
        )
        ratio = "" if extproc_us is None or not floor_us else f"{extproc_us / floor_us:.2f}"
        lines.append(
            f"| {r['prompt_kb']} KB | {r['router']} | {loaded['rps']:.0f} | "
            f"{loaded['rps'] / base['loaded']['rps']:.2f} | {low['p50_ms']:.2f} | "
            f"{low['p50_ms'] - base['low']['p50_ms']:+.2f} | "
            f"{loaded['envoy_cpu_us_per_request']:.0f} | "
            f"{'' if extproc_us is None else f'{extproc_us:.0f}'} | {ratio} |"
        )
    return lines


def bare_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The default (its per-request observers on) against extproc without them: the CPU
    per request the observability costs."""
    lines = [
        "",
        "## Observability on by default against none",
        "",
        (
            "extproc's CPU per request under the loaded runs; x bare is the median of the "
            "rounds' ratios (each round measures the two one after the other)."
        ),
        "",
        (
            "| prompt | bare us/req | default us/req | x bare | rounds' ratios | bare req/s "
            "| default req/s |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["prompt_kb"], r["router"]): r for r in rows if r.get("memo", "warm") == "warm"}
    for (kb, router), bare in by_key.items():
        if router != BARE:
            continue
        default = by_key[(kb, EXTPROC)]
        b_us = bare["loaded"]["extproc_cpu_us_per_request"]
        d_us = default["loaded"]["extproc_cpu_us_per_request"]
        paired = bare["default_cpu_ratios"]
        lines.append(
            f"| {kb} KB | {b_us:.0f} | {d_us:.0f} | {statistics.median(paired):.3f} | "
            f"{', '.join(f'{r:.2f}' for r in sorted(paired))} | "
            f"{bare['loaded']['rps']:.0f} | {default['loaded']['rps']:.0f} |"
        )
    return lines


def precise_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """precise-prefix-cache against the approximate default: extproc's CPU per request
    and its ratio, throughput and low-load p50, per prompt size and memo."""
    lines = [
        "",
        "## precise-prefix-cache against the approximate default",
        "",
        (
            "extproc's CPU per request (all its threads) under the loaded runs. A chat "
            "request is five segments between its added tokens; with a cold memo the "
            "system prompt's (nearly the whole prompt) is new each time, the others not."
        ),
        "",
        (
            "| prompt | memo | approximate us/req | precise us/req | x approximate | "
            "approximate req/s | precise req/s | p50 low load ms (approximate, precise) | "
            "segments from the memo |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["prompt_kb"], r.get("memo", "warm"), r["router"]): r for r in rows}
    for (kb, memo, router), precise in by_key.items():
        if router != PRECISE:
            continue
        approx = by_key[(kb, memo, EXTPROC)]
        a_us = approx["loaded"]["extproc_cpu_us_per_request"]
        p_us = precise["loaded"]["extproc_cpu_us_per_request"]
        lines.append(
            f"| {kb} KB | {memo} | {a_us:.0f} | {p_us:.0f} | {p_us / a_us:.2f} | "
            f"{approx['loaded']['rps']:.0f} | {precise['loaded']['rps']:.0f} | "
            f"{approx['low']['p50_ms']:.2f}, {precise['low']['p50_ms']:.2f} | "
            f"{precise['memo_hit_ratio']:.0%} |"
        )
    return lines


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
    parser.add_argument(
        "--model-dir",
        type=Path,
        help="the tokenizer of --variants precise (e.g. ~/.cache/extproc-e2e/model/qwen3-tiny)",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="also run every router with a cold memo (each prompt's start new), in turn",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown --variants {', '.join(sorted(unknown))}: choose of {VARIANTS}")
    if "precise" in args.variants and not (args.model_dir / "tokenizer.json").exists():
        parser.error("--variants precise needs --model-dir DIR holding tokenizer.json")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="extproc-floor-") as tmp:
        rows = run(args, Path(tmp))
    info = {**machine(), "load_average": f"{os.getloadavg()[0]:.1f}"}
    publish(markdown(rows, args, info), {"rows": rows}, args.json, args.markdown)
    print(f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
