"""least-latency (Score): favour pods whose recent TTFT and inter-token latency are low.

Kthena's least-latency formula, except for pods without data:

* inputs: ``Pod.metrics.ttft_s`` and ``.itl_s``, each the mean over the last scrape
  window (``extproc.datalayer.engine_metrics``), ``None`` without recent observations;
* per metric, over the candidates that have it: ``s = 100 * (max - x) / (max - min)``,
  100 for all when ``max == min``; a pod without that metric gets 50 for it;
* ``score = int(f * s_ttft + (1 - f) * s_itl)``, ``f = TTFTTPOTWeightFactor`` (default
  0.5; 0 ranks by ITL only, 1 by TTFT only; outside [0, 1] the default is used).

A pod with no latency data at all scores 50 (Kthena gives it 100, ranking an idle pod
level with the fastest one; 50 keeps it between the fastest and the slowest).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from extproc.scheduling.args import load_args
from extproc.scheduling.types import Cycle, PluginContext
from extproc.types import Pod, PodId, PodMetrics

NO_DATA_SCORE = 50.0


@dataclass(frozen=True, slots=True)
class LeastLatencyArgs:
    TTFTTPOTWeightFactor: float = field(default=0.5, metadata={"range": (0.0, 1.0)})


class LeastLatency:
    """Scores pods by recent TTFT and ITL, normalised over the candidates."""

    type_name: ClassVar[str] = "least-latency"

    def __init__(self, args: LeastLatencyArgs) -> None:
        self.args = args

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> LeastLatency:
        return cls(load_args(LeastLatencyArgs, args))

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        ttft = _normalised(pods, lambda m: m.ttft_s)
        itl = _normalised(pods, lambda m: m.itl_s)
        f = self.args.TTFTTPOTWeightFactor
        return {p.id: int(f * ttft[p.id] + (1 - f) * itl[p.id]) for p in pods}


def _normalised(
    pods: Sequence[Pod], get: Callable[[PodMetrics], float | None]
) -> dict[PodId, float]:
    """100 for the lowest value down to 0 for the highest; 50 without a value."""
    values = {p.id: get(p.metrics) for p in pods}
    known = [v for v in values.values() if v is not None]
    lo, hi = min(known, default=0.0), max(known, default=0.0)
    return {
        pod_id: NO_DATA_SCORE if v is None else 100.0 if hi == lo else 100.0 * (hi - v) / (hi - lo)
        for pod_id, v in values.items()
    }
