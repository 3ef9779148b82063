"""Values shared by every layer: pods and their load snapshot.

Values that cross modules are frozen, slotted dataclasses; background tasks publish new
ones by rebinding a snapshot, so the request path reads them without locks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

DEFAULT_NAMESPACE = "default"  # a pod's namespace when its source names none, as Kubernetes'
RANK_LABEL = "extproc.io/dp-rank"  # a data-parallel rank's index in its pod's ports


class PodId(NamedTuple):
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class PodRole(str, Enum):
    """Prefill/decode disaggregation role; ``BOTH`` is an ordinary pod."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


@dataclass(frozen=True, slots=True)
class LoraSlots:
    """vLLM's ``vllm:lora_requests_info``: the LoRA adapters with requests running (their
    weights in the engine's GPU slots) and waiting, and how many slots it has."""

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int = 0

    def has_free_slot(self) -> bool:
        return len(self.running | self.waiting) < self.max_lora


@dataclass(frozen=True, slots=True)
class PodMetrics:
    """Load as last scraped from the pod's /metrics (all zero until scraped)."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # 0.0-1.0
    ttft_s: float | None = None  # recent mean time to first token, None without data
    itl_s: float | None = None  # recent mean inter-token latency, None without data
    kv_capacity_tokens: int | None = None  # tokens the KV cache holds, None when not exposed
    # The engine's prefix-cache counters (vLLM's prefix_cache_hits/queries: prompt tokens
    # found cached / looked up) counted since extproc first scraped the pod; None when
    # the page has none (SGLang, older vLLM).
    prefix_cache_hits: float | None = None
    prefix_cache_queries: float | None = None
    lora: LoraSlots | None = None  # None when the page has no vllm:lora_requests_info


@dataclass(frozen=True, slots=True)
class Pod:
    """One inference server as the scheduler sees it."""

    id: PodId
    address: str  # "ip:port", exactly what Envoy's override_host receives
    models: frozenset[str] = frozenset()  # base models and the LoRA adapters it serves
    adapters: frozenset[str] = frozenset()  # those of ``models`` that are LoRA adapters
    labels: tuple[tuple[str, str], ...] = ()
    role: PodRole = PodRole.BOTH
    ready: bool = True
    metrics: PodMetrics = field(default_factory=PodMetrics)

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None

    @property
    def rank(self) -> int | None:
        """Its data-parallel rank (``RANK_LABEL``); None for a pod serving on one port."""
        value = self.label(RANK_LABEL)
        return int(value) if value is not None and value.isdigit() else None

    def serves(self, model: str) -> bool:
        return model in self.models


def adapters_of(pods: Iterable[Pod]) -> frozenset[str]:
    """The LoRA adapters any of ``pods`` serves."""
    return frozenset().union(*(p.adapters for p in pods))
