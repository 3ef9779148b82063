"""bench.flow_control's report: Markdown tables (per class, fairness, verdicts) and a PNG
chart beside them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.flow_workload import CLASSES, NOISY_TENANT

CLASS_COLUMNS = (
    "contender", "load", "class", "sent", "served", "TTFT p50 ms", "TTFT p99 ms",
    "goodput tok/s", "served tok/s", "refused (by status; with Retry-After)", "failed",
    "queued (mean s, p99 bound s); flow control's refusals",
)  # fmt: skip
SECTION_TITLE = "Flow control's section (appended to extproc's default scheduler configuration):"
GOALS = {
    "critical_ttft": "critical TTFT p99 overloaded <= 1.5x the TTFT p99 not overloaded, its own or extproc-off's if lower (ms)",
    "critical_not_refused": "no critical request refused",
    "fairness": "Jain's index over the standard tenants' tokens served overloaded >= 0.9",
    "goodput": "total goodput >= extproc without flow control's (tok/s)",
}


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def _queued(queued: dict[str, dict[str, Any]] | None, cls: str) -> str:
    if queued is None:
        return ""
    q = queued[cls]
    text = "0"
    if q["queued"]:
        text = f"{q['queued']:.0f} (mean {q['mean_s']:.2f}, p99 <= {q['p99_bound_s']:g})"
    reasons = ", ".join(f"{r} {n:.0f}" for r, n in sorted(q["refused_by_reason"].items()))
    return f"{text}; refused: {reasons}" if reasons else text


def _refused(s: dict[str, Any]) -> str:
    if not s["refused"]:
        return "0"
    statuses = ", ".join(f"{code}: {n}" for code, n in s["refused_by_status"].items())
    return f"{s['refused']} ({statuses}; {s['refused_with_retry_after']})"


def class_rows(contender: str, load: str, run: dict[str, Any]) -> list[str]:
    """One table line per class and one for all of them."""
    lines = []
    for cls in (*CLASSES, "all"):
        s = run["all"] if cls == "all" else run["classes"][cls]
        cells = [
            contender, load, cls, str(s["sent"]), str(s["served"]), _ms(s["ttft_p50_ms"]),
            _ms(s["ttft_p99_ms"]), f"{s['goodput_tok_s']:.0f}", f"{s['served_tok_s']:.0f}",
            _refused(s),
            f"{s['failed']}" + (f" {', '.join(s['errors'])}" if s["errors"] else ""),
            "" if cls == "all" else _queued(run.get("queued"), cls),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def class_table(results: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(CLASS_COLUMNS) + " |", "|" + "---|" * len(CLASS_COLUMNS)]
    for name, c in results["contenders"].items():
        lines += class_rows(name, f"{results['baseline_factor']}x", c["baseline"])
        lines += class_rows(name, f"{results['overload_factor']}x", c["overload"])
    return "\n".join(lines)


def fairness_table(results: dict[str, Any]) -> str:
    tenants = list(next(iter(results["contenders"].values()))["overload"]["tenant_tokens"])
    names = [f"{t} (noisy)" if t == NOISY_TENANT else t for t in tenants]
    lines = ["| contender | " + " | ".join(names) + " | Jain's index | over all served "
             "| over goodput |", "|" + "---|" * (len(tenants) + 4)]  # fmt: skip
    for name, c in results["contenders"].items():
        run = c["overload"]
        cells = [f"{run['tenant_tokens'][t]} ({run['tenant_tokens_all'][t]})" for t in tenants]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {run['jain']:.3f} | "
                     f"{run['jain_all']:.3f} | {run['jain_goodput']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def verdict_table(results: dict[str, Any]) -> str:
    lines = ["| contender | goal | measured | limit | verdict |", "|---|---|---|---|---|"]
    for name, c in results["contenders"].items():
        for goal, v in c["verdicts"].items():
            value = v["value"]
            shown = f"{value:.3f}" if goal == "fairness" else _ms(float(value))
            limit = f"{v['limit']:.3f}" if goal == "fairness" else _ms(float(v["limit"]))
            lines.append(f"| {name} | {GOALS[goal]} | {shown} | {limit} | "
                         f"{'pass' if v['pass'] else 'FAIL'} |")  # fmt: skip
    return "\n".join(lines)


def chart(results: dict[str, Any], out: Path) -> None:
    """Overloaded: TTFT p50 (bar) and p99 (dash) per class, the not-overloaded p99 as a
    dotted line per contender; goodput per class; the standard tenants' served tokens."""
    contenders = list(results["contenders"])
    width = 0.8 / len(contenders)
    drawn = [10.0]  # TTFTs drawn, for the log axis' range
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))
    for i, name in enumerate(contenders):
        c = results["contenders"][name]
        run = c["overload"]["classes"]
        xs = [k + i * width for k in range(len(CLASSES))]
        bars = ax1.bar(xs, [_nz(run[k]["ttft_p50_ms"]) for k in CLASSES], width, label=name)
        color = bars.patches[0].get_facecolor()
        ax1.scatter(xs, [_nz(run[k]["ttft_p99_ms"]) for k in CLASSES], marker="_", s=300,
                    color="black", zorder=3)  # fmt: skip
        ax1.axhline(_nz(c["baseline"]["all"]["ttft_p99_ms"]), color=color, linestyle=":")
        drawn += [_nz(run[k]["ttft_p99_ms"]) for k in CLASSES]
        drawn.append(_nz(c["baseline"]["all"]["ttft_p99_ms"]))
        ax2.bar(xs, [run[k]["goodput_tok_s"] for k in CLASSES], width, label=name)
        tenants = c["overload"]["tenant_tokens"]
        ax3.bar([k + i * width for k in range(len(tenants))], list(tenants.values()), width,
                label=f"{name} (Jain {c['overload']['jain']:.2f})")  # fmt: skip
    centers = [k + 0.4 - width / 2 for k in range(len(CLASSES))]
    for ax in (ax1, ax2):
        ax.set_xticks(centers, CLASSES)
    tenants = list(next(iter(results["contenders"].values()))["overload"]["tenant_tokens"])
    ax3.set_xticks([k + 0.4 - width / 2 for k in range(len(tenants))],
                   [f"{t}\n(noisy)" if t == NOISY_TENANT else t for t in tenants])  # fmt: skip
    ax1.set_ylim(1, 2 * max(drawn))  # before the log scale: all-equal TTFTs are no range
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT ms (bar p50, dash p99; dotted: p99 not overloaded)")
    ax2.set_ylabel(f"goodput tok/s (TTFT <= {results['slo_ttft_s']} s)")
    ax3.set_ylabel("standard band: output tokens served during the overload")
    ax1.legend(fontsize=8)
    ax3.legend(fontsize=8)
    fig.suptitle(f"Flow control at {results['overload_factor']}x the pods' capacity "
                 f"({results['capacity_req_s']:.1f} req/s)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _nz(value: float) -> float:
    """NaN (nothing served) drawn as nothing on a log axis."""
    return 0.0 if math.isnan(value) else value


def write(results: dict[str, Any], out_dir: Path, notes: str) -> Path:
    """``flow_control.md`` and ``flow_control.png`` into ``out_dir``; returns the file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    chart(results, out_dir / "flow_control.png")
    parts = [
        "# Flow control: priorities, fairness and a bounded queue under overload", "",
        notes, "", results["setup"], "", "## Goals", "", verdict_table(results), "",
        "## Per class", "", class_table(results), "",
        "## Fairness within the standard band (overloaded)", "", fairness_table(results), "",
        "![flow control](flow_control.png)", "", f"Run {results['utc']}:", "", "```",
        results["command"], "```", "",
    ]  # fmt: skip
    for name, section in results["flow_sections"].items():
        parts += [f"{name}: {SECTION_TITLE}", "", "```yaml", section.rstrip(), "```", ""]
    path = out_dir / "flow_control.md"
    path.write_text("\n".join(parts))
    return path
