"""A repetition's row as ``bench.routing_quality.summarize`` leaves it, for ``aggregate``."""

from __future__ import annotations

from typing import Any


def run_row(
    contender: str = "extproc-default", workload: str = "chat", rep: int = 0, **fields: Any
) -> dict[str, Any]:
    """One repetition's row; ``fields`` replace or add to the defaults."""
    return {
        "workload": workload, "contender": contender, "bound": 0.8, "rep": rep,
        "hit_ratio": 0.7, "ttft_p50_ms": 20.0, "ttft_p99_ms": 50.0, "req_per_s": 3.0,
        "out_tok_per_s": 10.0, "failed": 0, "errors": [], "per_pod": [1, 2], "wall_s": 30.0,
        "slowest": [], **fields,
    }  # fmt: skip
