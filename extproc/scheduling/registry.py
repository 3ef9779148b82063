"""Built-in plugins by configuration name: one explicit table, no import side effects."""

from __future__ import annotations

from extproc.scheduling.interfaces import Plugin
from extproc.scheduling.plugins.cost_aware import CostAware
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT
from extproc.scheduling.plugins.gpu_usage import GPUCacheUsage
from extproc.scheduling.plugins.least_latency import LeastLatency
from extproc.scheduling.plugins.least_request import LeastRequest
from extproc.scheduling.plugins.lora_affinity import LoraAffinity
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.scheduling.plugins.prefix_cache import PrefixCacheScorer
from extproc.scheduling.plugins.random_score import Random

BUILTIN: dict[str, type[Plugin]] = {
    cls.type_name: cls
    for cls in (
        LeastRequest,
        LeastLatency,
        GPUCacheUsage,
        PrefixCacheScorer,
        CostAware,
        EstimatedTTFT,
        PrecisePrefixCache,
        LoraAffinity,
        Random,
    )
}
