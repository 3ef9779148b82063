"""gpu-usage (Score): favour pods with free KV cache.

Kthena's gpu-usage plugin: ``score = int((1 - kv_usage) * 100)``, where ``kv_usage`` is
the scraped KV-cache usage, 0.0-1.0 (``vllm:kv_cache_usage_perc``,
``sglang:token_usage``). No arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from extproc.scheduling.types import Cycle, PluginContext
from extproc.types import Pod, PodId


class GPUCacheUsage:
    """Scores each pod by the share of its KV cache that is free."""

    type_name: ClassVar[str] = "gpu-usage"

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> GPUCacheUsage:
        return cls()

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        return {p.id: min(100, max(0, int((1.0 - p.metrics.kv_usage) * 100))) for p in pods}
