"""Where estimated-ttft's estimate and the pods' real waits part, offline.

    python -m bench.cost_model_gap [--workloads groups,multiturn,...] [--markdown F]

Replays workloads of the offline simulator (``extproc simulate``: simulated vLLM engines
in simulated time, metrics scraped every 200 ms as the server does) under a scheduler
configuration, and for every request compares what the picked pod's estimate assumed
with what the engine then did:

* the prompt tokens the pod would prefill (the view's ``uncached``) against the tokens
  the engine really computed (prompt less its ``num_cached_tokens``): a view that
  believes a pod holds a history the pod has evicted under-counts (``over-credit``);
* the wait before the request's first step, which the estimate prices by the queue it
  sees (scraped waiting/running, the router's own in-flight counts);
* the estimate in ms (``est_ms``, queue and prefill, before the write cost, hysteresis
  and sessions) against the request's real time to first token.

The configuration is a shipped one by name (``default``) or a YAML file; the comparison
is the shipped one as it was before issue 35 (``prefillMsPerToken: 0.1``, ``runningMs: 5``,
``writtenMs: 300``, no session term, every pod's view ``maxHashCacheSize`` blocks
whatever its cache).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from extproc.pods import Pod
from extproc.scheduling.config import SchedulerConfig, config_text, parse_config
from extproc.scheduling.interfaces import Cycle
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT
from extproc.sim.engine import EngineConfig
from extproc.sim.offline import SimSettings, simulate
from extproc.sim.policies import PrefixCachePolicy
from extproc.sim.workloads import (
    GroupsParams,
    Workload,
    groups_workload,
    multiturn_workload,
    tenants_workload,
)

WORKLOADS = ("groups", "multiturn", "tenants")
BEFORE = {"prefillMsPerToken": "0.1", "runningMs": "5.0", "writtenMs": "300.0", "sessionMs": "0"}
BEFORE_LABEL = "before (issue 35)"


@dataclass(frozen=True, slots=True)
class Estimate:
    uncached: int  # prompt tokens the view expects the pod to prefill
    est_ms: float  # queue and prefill, as estimated-ttft prices them
    prefill_ms: float  # of which the prefill of ``uncached``


class MeasuredPolicy(PrefixCachePolicy):
    """The configured scheduler, keeping the picked pod's estimate of every request."""

    def __init__(self, config: SchedulerConfig, sized_view: bool = True) -> None:
        super().__init__(config, seed=0)
        plugins = [p for p in self.scheduler.provisional if isinstance(p, EstimatedTTFT)]
        if not plugins:
            raise SystemExit("the configuration has no estimated-ttft scorer to measure")
        self.plugin = plugins[0]
        if not sized_view:  # as before issue 35: every pod's view holds maxHashCacheSize
            self.plugin.size_view = lambda pods: None  # type: ignore[method-assign]
        self.estimates: dict[str, Estimate] = {}

    def pick(self, item: Any, pods: Sequence[Pod]) -> int:
        # the estimate as the pick saw it: before the pick itself is counted in flight
        probe = Cycle(item.request)
        estimates = self.plugin.estimate_ms(probe, pods)
        idx = super().pick(item, pods)
        pod = self._pod_ids[idx]
        uncached = probe.num_prefill_tokens(pod)
        prefill_ms = self.plugin.args.prefillMsPerToken * uncached
        self.estimates[item.request_id] = Estimate(uncached, estimates[pod], prefill_ms)
        return idx


def config_with(text: str, changes: dict[str, str]) -> str:
    """``text`` with the estimated-ttft arguments in ``changes`` set (added if absent);
    the values are YAML scalars, as written in the file."""
    doc = yaml.safe_load(text)
    entry = next(e for e in doc["scheduler"]["pluginConfig"] if e["name"] == "estimated-ttft")
    args = entry.setdefault("args", {})
    for key, value in changes.items():
        args[key] = yaml.safe_load(value)
    return str(yaml.safe_dump(doc, sort_keys=False))


def workload(name: str) -> Workload:
    if name == "groups":
        return groups_workload(GroupsParams(rate_per_s=20.0, num_requests=1000))
    if name == "multiturn":
        return multiturn_workload()
    if name == "tenants":
        return tenants_workload()
    raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def measure(
    work: Workload,
    config: SchedulerConfig,
    scrape_s: float = 0.2,
    time_scale: float = 1.0,
    sized_view: bool = True,
) -> dict[str, float]:
    """The gaps of one replay (module doc), as medians and shares over its requests."""
    policy = MeasuredPolicy(config, sized_view)
    engine = EngineConfig(**{**work.engine_defaults, "time_scale": time_scale})
    run = simulate(work, policy, SimSettings(8, engine, scrape_s))
    rows = []
    for r in run.requests:
        est = policy.estimates[r.request_id]
        computed = r.num_prompt_tokens - r.num_cached_tokens
        rows.append((est, computed, r))
    over = [computed - est.uncached for est, computed, _ in rows]
    errors = [r.ttft_s * 1000 - est.est_ms for est, _, r in rows]
    hits = sum(r.num_cached_tokens for *_, r in rows)
    prompts = sum(r.num_prompt_tokens for *_, r in rows)
    ttfts = sorted(r.ttft_s * 1000 for *_, r in rows)
    wait_gap = sorted(r.queue_s * 1000 - (est.est_ms - est.prefill_ms) for est, _, r in rows)
    prefill_gap = sorted((r.ttft_s - r.queue_s) * 1000 - est.prefill_ms for est, _, r in rows)
    return {
        "requests": len(rows),
        "hit_ratio": hits / max(1, prompts),
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "over_credit_share": sum(1 for o in over if o > 16) / len(rows),
        "over_credit_tokens_mean": statistics.fmean(max(0, o) for o in over),
        "est_ms_median": statistics.median(est.est_ms for est, _, _ in rows),
        "ttft_minus_est_ms_median": statistics.median(errors),
        "queue_ms_p99": sorted(r.queue_s * 1000 for *_, r in rows)[int(0.99 * len(rows))],
        "wait_gap_ms_median": statistics.median(wait_gap),
        "wait_gap_ms_p99": wait_gap[int(0.99 * len(rows))],
        "prefill_gap_ms_median": statistics.median(prefill_gap),
        "prefill_gap_ms_p99": prefill_gap[int(0.99 * len(rows))],
    }


COLUMNS = (
    ("hit_ratio", "hit ratio", "{:.3f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("est_ms_median", "est ms median", "{:.0f}"),
    ("ttft_minus_est_ms_median", "TTFT - est ms median", "{:+.0f}"),
    ("over_credit_share", "picks over-credited", "{:.1%}"),
    ("over_credit_tokens_mean", "over-credit tokens mean", "{:.0f}"),
    ("queue_ms_p99", "queue p99 ms", "{:.0f}"),
    ("wait_gap_ms_median", "wait: real - est ms, median", "{:+.0f}"),
    ("wait_gap_ms_p99", "p99", "{:+.0f}"),
    ("prefill_gap_ms_median", "first step: real - est prefill ms, median", "{:+.0f}"),
    ("prefill_gap_ms_p99", "p99", "{:+.0f}"),
)


# (label, scrape interval s, engine time scale): as the benchmark runs, then the estimate's
# inputs made exact (metrics fresh at every arrival), then an engine slower than priced
CONDITIONS = (
    ("scraped every 200 ms", 0.2, 1.0),
    ("fresh metrics", 0.0, 1.0),
    ("engine 3x slower", 0.2, 3.0),
)


def markdown(results: dict[tuple[str, str, str], dict[str, float]]) -> str:
    head = "| workload | configuration | condition | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for (name, label, condition), row in results.items():
        cells = [fmt.format(row[key]) for key, _, fmt in COLUMNS]
        lines.append(f"| {name} | {label} | {condition} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cost_model_gap", description=__doc__)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--config", default="default", help="a shipped name or a YAML file")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args(argv)
    text, _ = config_text(args.config)
    configs = {
        BEFORE_LABEL: parse_config(config_with(text, BEFORE), "before"),
        args.config: parse_config(text, args.config),
    }
    results: dict[tuple[str, str, str], dict[str, float]] = {}
    for name in args.workloads.split(","):
        for label, config in configs.items():
            before = config is configs[BEFORE_LABEL]
            results[name, label, CONDITIONS[0][0]] = measure(
                workload(name), config, sized_view=not before
            )
        for condition, scrape_s, time_scale in CONDITIONS[1:]:
            results[name, args.config, condition] = measure(
                workload(name), configs[args.config], scrape_s, time_scale
            )
    table = markdown(results)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
