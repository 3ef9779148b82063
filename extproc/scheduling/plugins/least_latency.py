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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from extproc.scheduling.args import load_args
from extproc.scheduling.podtable import PodTable, Positions
from extproc.scheduling.types import Cycle, PluginContext, Scores
from extproc.types import Pod, PodId

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
        table = PodTable(pods)
        scores = self.score_table(cycle, table, table.all_positions())
        return dict(zip(table.ids, scores.tolist(), strict=True))

    def score_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Scores:
        """The same for every request of a snapshot: computed once per candidate set."""
        return table.memo((self, positions.tobytes()), lambda: self._score(table, positions))

    def _score(self, table: PodTable, positions: Positions) -> Scores:
        ttft = _normalised(table.ttft_s[positions], table.has_ttft[positions])
        itl = _normalised(table.itl_s[positions], table.has_itl[positions])
        f = self.args.TTFTTPOTWeightFactor
        # astype truncates toward zero, as int() does
        scores = (f * ttft + (1 - f) * itl).astype(np.int64)
        scores.flags.writeable = False  # shared by the snapshot's requests
        return scores


def _normalised(
    values: npt.NDArray[np.float64], known: npt.NDArray[np.bool_]
) -> npt.NDArray[np.float64]:
    """100 for the lowest value down to 0 for the highest; 50 without a value."""
    if not known.any():
        return np.full(len(values), NO_DATA_SCORE)
    lo, hi = float(values[known].min()), float(values[known].max())
    if hi == lo:
        return np.where(known, 100.0, NO_DATA_SCORE)
    return np.where(known, 100.0 * (hi - values) / (hi - lo), NO_DATA_SCORE)
