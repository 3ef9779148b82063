"""gpu-usage (Score): favour pods with free KV cache.

Kthena's gpu-usage plugin: ``score = int((1 - kv_usage) * 100)``, where ``kv_usage`` is
the scraped KV-cache usage, 0.0-1.0 (``vllm:kv_cache_usage_perc``,
``sglang:token_usage``). No arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from extproc.pods import Pod, PodId
from extproc.scheduling.interfaces import Cycle, PluginContext, Scores
from extproc.scheduling.podtable import PodTable, Positions


class GPUCacheUsage:
    """Scores each pod by the share of its KV cache that is free."""

    type_name: ClassVar[str] = "gpu-usage"
    args_type: ClassVar[None] = None  # no arguments

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> GPUCacheUsage:
        return cls()

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        table = PodTable(pods)
        scores = self.score_table(cycle, table, table.all_positions())
        return dict(zip(table.ids, scores.tolist(), strict=True))

    def score_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Scores:
        """The same for every request of a snapshot: computed once per candidate set."""
        return table.memo((self, positions.tobytes()), lambda: _score(table, positions))


def _score(table: PodTable, positions: Positions) -> Scores:
    # astype truncates toward zero, as int() does
    free = ((1.0 - table.kv_usage[positions]) * 100).astype(np.int64)
    scores = np.clip(free, 0, 100)
    scores.flags.writeable = False  # shared by the snapshot's requests
    return scores
