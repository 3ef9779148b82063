"""Summaries of simulator runs: a table, a JSON document and a PNG chart.

Per policy:

* ``hit_ratio`` = sum over engines of prefix-cache hit tokens / queried prompt tokens
  (vLLM's ``prefix_cache_hits`` / ``prefix_cache_queries``, the engines' own counters);
* TTFT mean, p50, p99 (linear interpolation) and max over finished requests, in seconds;
* adapter loads: LoRA adapters brought into a GPU slot, over all engines;
* per pod: requests routed, requests rejected, cached (hit) tokens, evicted blocks,
  adapter loads and the mean TTFT of its finished requests.

Floats are rounded to 6 decimals so a JSON report is byte-identical across runs with the
same inputs; wall time is printed but kept out of the JSON for the same reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from extproc.sim.offline import RunResult

DIGITS = 6


def summarize(run: RunResult) -> dict[str, Any]:
    """The per-policy figures of the module docstring, JSON-ready."""
    ttfts = np.array([r.ttft_s for r in run.requests], dtype=np.float64)
    pod_of = np.array([r.pod_idx for r in run.requests], dtype=np.int64)
    queries = sum(p.prefix_cache_queries for p in run.pods)
    hits = sum(p.prefix_cache_hits for p in run.pods)
    if len(ttfts):
        p50, p99 = np.percentile(ttfts, [50, 99]).tolist()
        ttft = {"mean": _mean(ttfts), "p50": p50, "p99": p99, "max": ttfts.max()}
    else:
        ttft = {"mean": None, "p50": None, "p99": None, "max": None}
    return {
        "num_finished": len(run.requests),
        "num_rejected": sum(p.num_rejected for p in run.pods),
        "num_refused": run.num_refused,
        "hit_ratio": _round(hits / queries if queries else 0.0),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "ttft_s": {k: _round(v) for k, v in ttft.items()},
        "num_evicted_blocks": sum(p.num_evicted_blocks for p in run.pods),
        "num_lora_loads": sum(p.num_lora_loads for p in run.pods),
        "sim_duration_s": _round(max((r.finished_s for r in run.requests), default=0.0)),
        "pods": [
            {
                "name": p.name,
                "num_requests": p.num_requests,
                "num_rejected": p.num_rejected,
                "cached_tokens": p.prefix_cache_hits,
                "num_evicted_blocks": p.num_evicted_blocks,
                "num_lora_loads": p.num_lora_loads,
                "ttft_mean_s": _round(_mean(ttfts[pod_of == pod_idx])),
            }
            for pod_idx, p in enumerate(run.pods)
        ],
    }


def _mean(values: npt.NDArray[np.float64]) -> float | None:
    return float(values.mean()) if len(values) else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), DIGITS)


def format_table(summaries: Mapping[str, Mapping[str, Any]], runs: Sequence[RunResult]) -> str:
    """A fixed-width table, one row per policy, with the run's wall time."""
    header = (
        f"{'policy':<16}{'hit':>7}{'ttft mean':>11}{'p50':>9}{'p99':>9}{'max':>9}"
        f"{'evicted':>9}{'loads':>7}{'rej':>5}{'429':>5}{'wall s':>8}{'req/s':>9}  requests per pod"
    )
    lines = [header, "-" * len(header)]
    for run in runs:
        s = summaries[run.policy]
        t = s["ttft_s"]
        num = s["num_finished"] + s["num_rejected"] + s["num_refused"]
        per_pod = " ".join(str(p["num_requests"]) for p in s["pods"])
        lines.append(
            f"{run.policy:<16}{s['hit_ratio']:>7.3f}{_ms(t['mean']):>11}{_ms(t['p50']):>9}"
            f"{_ms(t['p99']):>9}{_ms(t['max']):>9}{s['num_evicted_blocks']:>9}"
            f"{s['num_lora_loads']:>7}"
            f"{s['num_rejected']:>5}{s['num_refused']:>5}{run.wall_s:>8.2f}{num / max(run.wall_s, 1e-9):>9.0f}"
            f"  {per_pod}"
        )
    lines.append(
        "TTFT in ms; hit = engine prefix-cache hit tokens / prompt tokens; loads = LoRA "
        "adapters brought into a GPU slot; rej = refused by an engine, 429 = refused by the "
        "router (filters left no pod)"
    )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def write_json(path: Path, config: Mapping[str, Any], summaries: Mapping[str, Any]) -> None:
    """``{"config": ..., "policies": {name: summary}}``, sorted keys, indented."""
    doc = {"config": config, "policies": summaries}
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")


def write_png(path: Path, title: str, summaries: Mapping[str, Mapping[str, Any]]) -> None:
    """Bars per policy: hit ratio; TTFT mean and p99; requests per pod."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summaries)
    x = np.arange(len(names))
    fig, (ax_hit, ax_ttft, ax_pods) = plt.subplots(1, 3, figsize=(15, 4.5))
    ax_hit.bar(x, [summaries[n]["hit_ratio"] for n in names], color="tab:green")
    ax_hit.set_ylabel("engine prefix-cache hit ratio")
    ax_hit.set_ylim(0, 1)
    for offset, key, color in ((-0.2, "mean", "tab:blue"), (0.2, "p99", "tab:red")):
        values = [summaries[n]["ttft_s"][key] or 0.0 for n in names]
        ax_ttft.bar(x + offset, values, width=0.4, label=f"TTFT {key}", color=color)
    ax_ttft.set_ylabel("seconds")
    ax_ttft.legend()
    num_pods = max(len(summaries[n]["pods"]) for n in names)
    width = 0.8 / num_pods
    for pod_idx in range(num_pods):
        counts = [summaries[n]["pods"][pod_idx]["num_requests"] for n in names]
        ax_pods.bar(x - 0.4 + (pod_idx + 0.5) * width, counts, width=width)
    ax_pods.set_ylabel("requests per pod")
    for ax in (ax_hit, ax_ttft, ax_pods):
        ax.set_xticks(x, names, rotation=20, ha="right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
