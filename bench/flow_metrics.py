"""bench.flow_control's figures: per-class summaries, goodput, Jain's index, time queued
from extproc's histogram, and the verdict on each goal.

Definitions (the report repeats them):

- served: answered 200 and streamed to ``[DONE]``;
- refused: answered 429 (extproc, sglang-router's full queue), 408 (sglang-router's
  queue timeout) or 503; failed: anything else not served (5xx, a broken stream, the
  run's deadline);
- goodput: output tokens a second, over the arrivals' duration, of the requests served
  with a time to first token within the SLO;
- Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` (1 when equal, 1/n when one
  tenant has everything) over the standard band's tenants' output tokens served while
  the schedule lasts (requests ended before its end): the share each tenant gets while
  the pods are saturated. After the last arrival the backlog drains, whoever it belongs
  to, so the index over every served token (``jain_all``) drifts to the arrivals'
  shares; ``jain_goodput`` counts the tokens within the SLO.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.flow_client import FlowOutcome
from bench.flow_workload import CLASSES, PRIORITIES

REFUSALS = (429, 408, 503)
QUEUED_METRIC = "extproc_flow_queued_seconds"
REFUSED_METRIC = "extproc_flow_refused_total"
CRITICAL_P99_RATIO = 1.5  # goal: critical TTFT p99 overloaded <= this x not overloaded
FAIRNESS_GOAL = 0.9


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest rank (the value below which a fraction ``q`` falls); NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index; NaN when there is nothing to share."""
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else math.nan


def goodput_tokens(outcomes: Iterable[FlowOutcome], slo_s: float) -> int:
    """Output tokens of the requests served with a TTFT within ``slo_s``."""
    return sum(
        o.completion_tokens for o in outcomes if o.ok and o.ttft_s is not None and o.ttft_s <= slo_s
    )


def tenant_tokens(outcomes: Iterable[FlowOutcome], tenants: Iterable[str]) -> dict[str, int]:
    """Served output tokens of each of ``tenants`` among ``outcomes`` (zero for a tenant
    served nothing)."""
    out = dict.fromkeys(tenants, 0)
    for o in outcomes:
        if o.ok and o.tenant in out:
            out[o.tenant] += o.completion_tokens
    return out


def class_summary(
    outcomes: Sequence[FlowOutcome], duration_s: float, slo_s: float
) -> dict[str, Any]:
    """One class's (or all classes') figures over one run."""
    served = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s * 1000 for o in served if o.ttft_s is not None]
    refused = [o for o in outcomes if o.status in REFUSALS]
    failed = [o for o in outcomes if not o.ok and o.status not in REFUSALS]
    return {
        "sent": len(outcomes),
        "served": len(served),
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p99_ms": percentile(ttfts, 0.99),
        "goodput_tok_s": goodput_tokens(served, slo_s) / duration_s,
        "served_tok_s": sum(o.completion_tokens for o in served) / duration_s,
        "refused": len(refused),
        "refused_by_status": {
            str(c): sum(o.status == c for o in refused)
            for c in REFUSALS
            if any(o.status == c for o in refused)
        },
        "refused_with_retry_after": sum(o.retry_after is not None for o in refused),
        "failed": len(failed),
        "errors": sorted({o.error for o in failed}),
    }


def run_summary(
    outcomes: Sequence[FlowOutcome], duration_s: float, slo_s: float, tenants: Sequence[str]
) -> dict[str, Any]:
    """Per class and all together, and Jain's index over the standard band's tenants."""
    by_class = {c: class_summary([o for o in outcomes if o.cls == c], duration_s, slo_s)
                for c in CLASSES}  # fmt: skip
    standard = [o for o in outcomes if o.cls == "standard" and o.ok]
    window = tenant_tokens((o for o in standard if o.end_s <= duration_s), tenants)
    served = tenant_tokens(standard, tenants)
    good = tenant_tokens((o for o in standard if (o.ttft_s or math.inf) <= slo_s), tenants)
    return {
        "classes": by_class,
        "all": class_summary(outcomes, duration_s, slo_s),
        "tenant_tokens": window,
        "jain": jain(list(window.values())),
        "tenant_tokens_all": served,
        "jain_all": jain(list(served.values())),
        "jain_goodput": jain(list(good.values())),
    }


def flow_samples(text: str) -> dict[tuple[str, str, str], float]:
    """Flow control's time queued and refusals from a ``/metrics`` page, outcomes summed:
    (sample, priority, bucket bound or refusal reason) -> value."""
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(QUEUED_METRIC):
                key = (s.name, s.labels.get("priority", ""), s.labels.get("le", ""))
            elif s.name == REFUSED_METRIC:
                key = (s.name, s.labels.get("priority", ""), s.labels.get("reason", ""))
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


def sample_delta(
    after: Mapping[tuple[str, str, str], float], before: Mapping[tuple[str, str, str], float]
) -> dict[tuple[str, str, str], float]:
    """What was counted between two scrapes."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def bucket_bound(buckets: Mapping[float, float], q: float) -> float:
    """The upper bound of the histogram bucket holding rank ``q`` (the buckets are too
    coarse to interpolate: a 15 s time to live falls in the 10-30 s bucket); NaN when
    empty."""
    total = max(buckets.values(), default=0.0)
    if total <= 0:
        return math.nan
    return next(le for le in sorted(buckets) if buckets[le] >= q * total)


def queued_by_class(delta: Mapping[tuple[str, str, str], float]) -> dict[str, dict[str, Any]]:
    """Per class: requests that left the queue (dispatched, refused or cancelled), their
    mean time queued, the bucket bound of its p99, and flow control's refusals by reason."""
    out: dict[str, dict[str, Any]] = {}
    for cls, priority in PRIORITIES.items():
        p = str(priority)
        count = delta.get((QUEUED_METRIC + "_count", p, ""), 0.0)
        total = delta.get((QUEUED_METRIC + "_sum", p, ""), 0.0)
        buckets = {float(le): n for (name, prio, le), n in delta.items()
                   if name == QUEUED_METRIC + "_bucket" and prio == p}  # fmt: skip
        reasons = {reason: n for (name, prio, reason), n in delta.items()
                   if name == REFUSED_METRIC and prio == p and n}  # fmt: skip
        out[cls] = {"queued": count, "mean_s": total / count if count else math.nan,
                    "p99_bound_s": bucket_bound(buckets, 0.99), "refused_by_reason": reasons}  # fmt: skip
    return out


def verdicts(
    overload: Mapping[str, Any],
    baseline: Mapping[str, Any],
    reference_goodput: float | None,
    reference_baseline_p99: float | None = None,
) -> dict[str, dict[str, Any]]:
    """Each goal's figure, limit and pass/fail for one contender: ``overload`` and
    ``baseline`` are its ``run_summary``s; ``reference_goodput`` the total goodput of
    extproc without flow control under the same overload, ``reference_baseline_p99`` its
    TTFT p99 not overloaded (None: it did not run). The critical limit is 1.5x the lower
    of the contender's own p99 not overloaded and extproc-off's: the same pods without
    overload, so that a contender slower unloaded (a reserve holding its standard band at
    bursts) is not judged against its own slower run."""
    crit = overload["classes"]["critical"]
    reference_p99 = min(
        baseline["all"]["ttft_p99_ms"],
        math.inf if reference_baseline_p99 is None else reference_baseline_p99,
    )
    limit = CRITICAL_P99_RATIO * reference_p99
    out = {
        "critical_ttft": {"value": crit["ttft_p99_ms"], "limit": limit,
                          "pass": crit["ttft_p99_ms"] <= limit},
        "critical_not_refused": {"value": crit["refused"], "limit": 0,
                                 "pass": crit["refused"] == 0},
        "fairness": {"value": overload["jain"], "limit": FAIRNESS_GOAL,
                     "pass": overload["jain"] >= FAIRNESS_GOAL},
    }  # fmt: skip
    if reference_goodput is not None:
        good = overload["all"]["goodput_tok_s"]
        out["goodput"] = {"value": good, "limit": reference_goodput,
                          "pass": good >= reference_goodput}  # fmt: skip
    return out
