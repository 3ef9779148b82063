"""The routing-quality report: one Markdown file with tables, and PNG charts beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLUMNS = (
    "workload", "contender", "hit ratio", "bound", "TTFT p50 ms", "TTFT p99 ms", "RR p99 ms",
    "req/s", "out tok/s", "failed", "requests per pod", "chat turns lost history",
    "adapter loads", "verdict vs best peer",
)  # fmt: skip
ROUND_ROBIN = "envoy-rr"  # the baseline whose p99 every extproc row must beat


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [
            r["workload"], r["contender"], f"{r['hit_ratio']:.3f}", f"{r['bound']:.3f}",
            f"{r['ttft_p50_ms']:.0f}", _p99(r), _rr_cell(rows, r["workload"]),
            f"{r['req_per_s']:.1f}", f"{r['out_tok_per_s']:.0f}", str(r["failed"]),
            " ".join(str(int(n)) for n in r["per_pod"]), history_cell(r), _loads_cell(r),
            r.get("verdict", ""),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _p99(row: dict[str, Any]) -> str:
    """The median p99, with each repetition's in brackets when there were several."""
    each = row.get("ttft_p99_each_ms", [])
    median = f"{row['ttft_p99_ms']:.0f}"
    return median if len(each) < 2 else f"{median} ({' / '.join(f'{v:.0f}' for v in each)})"


def rr_p99(rows: list[dict[str, Any]]) -> float | None:
    """Round robin's (``envoy-rr``'s) median TTFT p99 among ``rows`` of one workload, the
    p99 every ``extproc-*`` row must beat; None when it did not run."""
    return next((r["ttft_p99_ms"] for r in rows if r["contender"] == ROUND_ROBIN), None)


def _rr_cell(rows: list[dict[str, Any]], workload: str) -> str:
    """Computed from the rows, so results written before the column render too."""
    p99 = rr_p99([r for r in rows if r["workload"] == workload])
    return "" if p99 is None else f"{p99:.0f}"


def _loads_cell(row: dict[str, Any]) -> str:
    """LoRA adapters brought into a GPU slot (the simulated pods count them); empty for
    workloads without adapters and results recorded before the column."""
    return f"{row['adapter_loads']:.0f}" if row.get("adapter_loads") else ""


def history_cell(row: dict[str, Any]) -> str:
    """Chat turns that did not find their own history cached, of those checked
    (``routing_quality.lost_histories``); empty for a workload without chats."""
    if "history_turns" not in row:
        return ""
    return f"{row['history_lost']} of {row['history_turns']}"


def _grouped(rows: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    return workloads, contenders


def chart(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    """Hit ratio (with the bound) and TTFT p50/p99 per workload, one bar per contender."""
    workloads, contenders = _grouped(rows)
    by = {(r["workload"], r["contender"]): r for r in rows}
    width = 0.8 / len(contenders)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, c in enumerate(contenders):
        xs = [w + i * width for w in range(len(workloads))]
        ax1.bar(xs, [by[(w, c)]["hit_ratio"] if (w, c) in by else 0 for w in workloads],
                width, label=c)  # fmt: skip
        ax2.bar(xs, [by[(w, c)]["ttft_p50_ms"] if (w, c) in by else 0 for w in workloads],
                width, label=c)  # fmt: skip
        ax2.scatter(xs, [by[(w, c)]["ttft_p99_ms"] if (w, c) in by else 0 for w in workloads],
                    marker="_", s=200, color="black")  # fmt: skip
    centers = [w + 0.4 - width / 2 for w in range(len(workloads))]
    bounds = [next(r["bound"] for r in rows if r["workload"] == w) for w in workloads]
    ax1.scatter(centers, bounds, marker="*", s=120, color="black", label="bound", zorder=3)
    for ax, label in ((ax1, "engine prefix hit ratio"), (ax2, "TTFT ms (bar p50, dash p99)")):
        ax.set_xticks(centers, workloads)
        ax.set_ylabel(label)
    ax2.set_yscale("log")
    ax2.set_ylim(bottom=1)
    ax1.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def write(results: dict[str, Any], out_dir: Path, notes: str) -> Path:
    """Write ``routing_quality.md`` and its charts into ``out_dir``; returns the file. Each
    section (pod set) of ``results["runs"]`` comes with the command, configuration and
    UTC times of the run that made it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = ["# Routing quality: extproc against Envoy round robin and the peer routers", ""]
    parts += [notes, ""]
    for kind, section in results["runs"].items():
        png = f"routing_quality_{kind}.png"
        chart(section["rows"], out_dir / png, section["title"])
        parts += [f"## {section['title']}", "", section["setup"], "", table(section["rows"]), "",
                  f"![{kind}]({png})", "", f"Run {section.get('utc', '(time not recorded)')}:",
                  "", "```", section["command"], "```", "", "```json", section["config_json"],
                  "```", ""]  # fmt: skip
    path = out_dir / "routing_quality.md"
    path.write_text("\n".join(parts))
    return path


def merged(new: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    """``new``'s sections with ``old``'s of the pod sets this run did not touch, in the
    order of their names (a file of the earlier layout lends its one command and
    configuration to each of its sections)."""
    old = old or {}
    runs = {
        kind: {"command": old.get("command", ""), "config_json": old.get("config_json", "{}"),
               **section}
        for kind, section in old.get("runs", {}).items()
        if kind not in new["runs"]
    }  # fmt: skip
    runs.update(new["runs"])
    return {"runs": dict(sorted(runs.items()))}
