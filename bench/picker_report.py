"""The proxy benchmark's report: the machine, per-cell medians and ratios, Markdown tables.

python -m bench.picker_report bench/results/picker.json   # the tables again, from a run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

from e2e.real_vllm.prepare import PEERS
from extproc.sim.launch import envoy_binary

ENVOY = "envoy"
EXTPROC = "envoy+extproc"
SGLANG = "sglang-router"
LOW_LOAD_TARGET_MS = 0.5  # the bound on p50 added by the picker at low load


def machine() -> dict[str, Any]:
    """CPU model and core count (``/proc/cpuinfo``), load average and the git commit."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
              if line.startswith("model name")]  # fmt: skip
    sha = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True)
    envoy = subprocess.run(
        [envoy_binary(), "--version"], check=False, capture_output=True, text=True
    )
    return {
        "cpu_model": models[0] if models else "unknown",
        "cores": cpuinfo.count("\nprocessor") + cpuinfo.startswith("processor"),
        "load_average": list(os.getloadavg()),
        "git_sha": sha.stdout.strip(),
        "envoy_version": envoy.stdout.strip().rsplit(" ", 1)[-1],
        "sglang_router": PEERS[SGLANG],
    }


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's median over the runs (counts of failures: their sum)."""
    out = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    for k in ("non_2xx", "socket_errors"):
        out[k] = sum(r[k] for r in runs)
    return out


def ratios(summary: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """Throughput against Envoy alone, and the latency each router adds to it."""
    alone, low_alone = summary[ENVOY]["loaded"], summary[ENVOY]["low"]
    out: dict[str, float] = {}
    for name in (EXTPROC, SGLANG):
        if name not in summary:
            continue
        loaded, low = summary[name]["loaded"], summary[name]["low"]
        out[f"{name} throughput vs envoy"] = round(loaded["rps"] / alone["rps"], 3)
        out[f"{name} p50 added ms"] = round(loaded["p50_ms"] - alone["p50_ms"], 3)
        out[f"{name} p99 added ms"] = round(loaded["p99_ms"] - alone["p99_ms"], 3)
        out[f"{name} low-load p50 added ms"] = round(low["p50_ms"] - low_alone["p50_ms"], 3)
    if SGLANG in summary:
        out["extproc throughput vs sglang"] = round(
            summary[EXTPROC]["loaded"]["rps"] / summary[SGLANG]["loaded"]["rps"], 3
        )
    return out


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _header(columns: list[str]) -> list[str]:
    return [_row(columns), "|" + "---|" * len(columns)]


def _cpu(m: dict[str, float], role: str) -> str:
    key = f"{role}_cpu_us_per_request"
    return f"{m[key]:.0f}" if key in m else ""


def _total(m: dict[str, float], suffix: str) -> float:
    return sum(v for k, v in m.items() if k.endswith(suffix))


def loaded_table(cells: list[dict[str, Any]]) -> str:
    """Per cell and router: throughput, latency, CPU per request by process, failures."""
    lines = _header(["prompt", "pods", "router", "req/s", "req/s runs", "x envoy", "p50 ms", "p99 ms",
                     "envoy us/req", "extproc us/req", "sglang us/req", "all us/req",
                     "all, net of idle", "failed"])  # fmt: skip
    for cell in cells:
        alone = cell["summary"][ENVOY]["loaded"]["rps"]
        for name, s in cell["summary"].items():
            m = s["loaded"]
            runs = [r["rps"] for r in cell["runs"][name]["loaded"]]
            lines.append(_row([
                f"{cell['prompt_kb']} KB", cell["pods"], name, f"{m['rps']:.0f}",
                f"{min(runs):.0f}-{max(runs):.0f}",
                f"{m['rps'] / alone:.2f}", f"{m['p50_ms']:.2f}", f"{m['p99_ms']:.2f}",
                _cpu(m, "envoy"), _cpu(m, "extproc"), _cpu(m, "router"),
                f"{_total(m, '_cpu_us_per_request'):.0f}",
                f"{_total(m, '_net_us_per_request'):.0f}",
                int(m["non_2xx"] + m["socket_errors"]),
            ]))  # fmt: skip
    return "\n".join(lines)


def low_load_table(cells: list[dict[str, Any]]) -> str:
    lines = _header(["prompt", "pods", "envoy p50 ms", "envoy+extproc p50 ms", "added ms",
                     f"<= {LOW_LOAD_TARGET_MS} ms", "sglang-router p50 ms", "added ms"])  # fmt: skip
    for cell in cells:
        s = cell["summary"]
        alone, ext = s[ENVOY]["low"]["p50_ms"], s[EXTPROC]["low"]["p50_ms"]
        sgl = s[SGLANG]["low"]["p50_ms"] if SGLANG in s else None
        lines.append(_row([
            f"{cell['prompt_kb']} KB", cell["pods"], f"{alone:.3f}", f"{ext:.3f}",
            f"{ext - alone:+.3f}", "yes" if ext - alone <= LOW_LOAD_TARGET_MS else "no",
            "" if sgl is None else f"{sgl:.3f}", "" if sgl is None else f"{sgl - alone:+.3f}",
        ]))  # fmt: skip
    return "\n".join(lines)


def warm_table(cells: list[dict[str, Any]]) -> str:
    """Per cell: the prefixes, how many pods extproc sent them to, the warm-up's length."""
    lines = _header(["prompt", "pods", "prefixes", "pods with index entries",
                     "warm-up requests (extproc)", "warm-up requests (sglang)"])  # fmt: skip
    for cell in cells:
        warm = cell["warm_requests"]
        lines.append(_row([
            f"{cell['prompt_kb']} KB", cell["pods"], cell["num_prefixes"],
            cell["pods_with_entries"], warm.get(EXTPROC, ""), warm.get(SGLANG, ""),
        ]))  # fmt: skip
    return "\n".join(lines)


def idle_table(cells: list[dict[str, Any]]) -> str:
    """Per pod count: each process's CPU % with no requests (extproc scrapes every pod)."""
    first = {c["pods"]: c["idle_cpu_pct"] for c in cells}
    names = list(next(iter(first.values()))) if first else []
    lines = _header(["pods", *names])
    lines += [_row([pods, *(f"{idle[n]:.1f}" for n in names)]) for pods, idle in first.items()]
    return "\n".join(lines)


SCALE_P99_TARGET = 3.0  # issue 31: p99 under load at 1,000 pods at most 3x the 16-pod p99
SCALE_CPU_TARGET = 1.5  # and extproc's CPU a request at most 1.5x


def scaling_table(cells: list[dict[str, Any]]) -> str:
    """Per prompt size: Envoy + extproc at the most pods against the fewest, loaded: p99
    and extproc's CPU a request, all of it and net of what it burns idle (the scraper's
    sweeps, bounded by its CPU budget whatever the request rate)."""
    by_size: dict[int, dict[int, dict[str, float]]] = {}
    for cell in cells:
        by_size.setdefault(cell["prompt_kb"], {})[cell["pods"]] = cell["summary"][EXTPROC]["loaded"]
    lines = _header(["prompt", "pods", "p99 x", f"<= {SCALE_P99_TARGET:g}x",
                     "extproc us/req", "x", "net of idle", "x", f"<= {SCALE_CPU_TARGET:g}x"])  # fmt: skip
    for kb, by_pods in by_size.items():
        if len(by_pods) < 2:
            continue
        few, many = by_pods[min(by_pods)], by_pods[max(by_pods)]
        p99 = many["p99_ms"] / few["p99_ms"]
        gross = many["extproc_cpu_us_per_request"] / few["extproc_cpu_us_per_request"]
        net = many["extproc_net_us_per_request"] / few["extproc_net_us_per_request"]
        lines.append(_row([
            f"{kb} KB", f"{max(by_pods)} / {min(by_pods)}", f"{p99:.2f}",
            "yes" if p99 <= SCALE_P99_TARGET else "no",
            f"{many['extproc_cpu_us_per_request']:.0f} / {few['extproc_cpu_us_per_request']:.0f}",
            f"{gross:.2f}",
            f"{many['extproc_net_us_per_request']:.0f} / {few['extproc_net_us_per_request']:.0f}",
            f"{net:.2f}", "yes" if net <= SCALE_CPU_TARGET else "no",
        ]))  # fmt: skip
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """The whole report: machine, load, the three tables."""
    m, c = result["machine"], result["config"]
    host = (
        f"{m['cpu_model']}, {m['cores']} cores, load average {m['load_average'][0]:.2f}"
        f" at start; commit {m['git_sha'][:12]}; {result['elapsed_s']:.0f} s in all."
    )
    load = (
        f"Loaded: wrk -t{c['threads']} -c{c['connections']} -d{c['seconds']}s; low load:"
        f" wrk -t1 -c1 -d{c['low_seconds']}s; medians of {c['rounds']} alternating rounds."
    )
    workload = (
        f"Chat requests over {c['prefixes_per_pod']} distinct prefixes per pod, picked at random,"
        " after a warm-up that sends every prefix once through each router (bench/loadgen.py)."
        f" Envoy {m['envoy_version'].split('/')[1]}, {m['sglang_router']} (cache_aware)."
    )
    return "\n".join([
        "# Envoy + extproc against Envoy alone and sglang-router (instant upstreams)", "",
        host, "", load, "", workload, "",
        "## Loaded", "", loaded_table(result["cells"]), "",
        "## Low load: p50 added", "", low_load_table(result["cells"]), "",
        "## Many pods against few (Envoy + extproc, loaded)", "", scaling_table(result["cells"]),
        "",
        "## Workload state", "", warm_table(result["cells"]), "",
        "## Idle CPU % (one core = 100), before the first cell (after the first sweeps)", "",
        idle_table(result["cells"]),
        "",
    ])  # fmt: skip


def publish(
    text: str, data: dict[str, Any], json_path: Path | None, markdown_path: Path | None
) -> None:
    """Print a benchmark's tables; write its data (with the machine) and tables if asked."""
    print(text)
    if json_path:
        json_path.write_text(json.dumps({"machine": machine(), **data}, indent=2) + "\n")
    if markdown_path:
        markdown_path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description="The tables of a bench.picker JSON result.")
    parser.add_argument("result", type=Path, help="the JSON of bench.picker --json")
    parser.add_argument("--markdown", type=Path, help="write the tables here too")
    args = parser.parse_args()
    report = markdown(json.loads(args.result.read_text()))
    print(report)
    if args.markdown:
        args.markdown.write_text(report)


if __name__ == "__main__":
    main()
