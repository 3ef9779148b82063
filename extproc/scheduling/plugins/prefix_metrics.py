"""The spec's three prefix-cache series, for every plugin that keeps a recorded prefix view.

``kthena-prefix-cache-plugin.txt`` defines them for the prefix-cache plugin's view:

* ``kthena_router_prefix_cache_match_ratio{model}``: the best pod's fraction of the
  prompt's blocks, each time the plugin scores (Kthena's buckets; 0 is a miss);
* ``kthena_router_prefix_cache_evictions_total{model}``: entries dropped because a pod's
  list was full, counted as Kthena counts them, labelled with the evicted entry's model;
* ``kthena_router_prefix_cache_entries``: entries stored across all pods.

estimated-ttft keeps the same kind of view (Kthena's block hashing and per-pod LRU,
recorded on success) and emits the same series for it, so the dashboard's prefix-cache row
(and Kthena's own dashboard) reads the shipped default too. One ``PrefixCacheMetrics`` per
registry (``build_scheduler`` hands it to the plugins in ``PluginContext``): with both
plugins configured, each observes its own match ratio when it scores, the evictions count
both views' and the entries gauge is their sum.
"""

from __future__ import annotations

import threading
from functools import cache

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.pods import PodId
from extproc.prefix.hashing import Keys
from extproc.prefix.index import PrefixIndex

MATCH_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)  # Kthena's


class _Series:
    """The three series, registered in one registry."""

    def __init__(self, registry: CollectorRegistry, indexes: list[PrefixIndex]) -> None:
        match_ratio = Histogram(
            "kthena_router_prefix_cache_match_ratio",
            "Fraction of the prompt's blocks matched by the best pod, each time a plugin "
            "with a recorded prefix view scores pods (0 is a miss).",
            ["model"],
            registry=registry,
            buckets=MATCH_RATIO_BUCKETS,
        )
        self.match_ratio = cache(match_ratio.labels)  # a model's child, made once
        self.evictions = Counter(
            "kthena_router_prefix_cache_evictions",
            "Prefix-cache entries dropped because a pod's list was full.",
            ["model"],
            registry=registry,
        )
        Gauge(
            "kthena_router_prefix_cache_entries",
            "Prefix-cache entries currently stored across all pods.",
            registry=registry,
        ).set_function(lambda: sum(index.num_entries for index in indexes))


class PrefixCacheMetrics:
    """The three series, registered when the first view attaches."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._indexes: list[PrefixIndex] = []
        self._series: _Series | None = None
        self._model_tags: dict[str, int] = {}  # index entries are tagged with their model
        self._tag_models: list[str] = []
        self._tags_lock = threading.Lock()

    def attach(self, index: PrefixIndex) -> None:
        """Count ``index``'s entries in the gauge (a plugin calls it when it is built,
        before it observes or records)."""
        if self._series is None:
            self._series = _Series(self._registry, self._indexes)
        self._indexes.append(index)

    def observe_match(self, model: str, matched_blocks: int, num_blocks: int) -> None:
        """The best pod matched ``matched_blocks`` of the prompt's ``num_blocks``."""
        if self._series is not None:
            self._series.match_ratio(model).observe(matched_blocks / num_blocks)

    def record(self, index: PrefixIndex, keys: Keys, pod: PodId, model: str) -> None:
        """Record ``keys`` for ``pod`` in ``index``, counting its evictions by model."""
        evicted = index.record_tagged(keys, pod, self._tag(model))
        if evicted and self._series is not None:
            for tag, count in evicted.items():
                self._series.evictions.labels(self._tag_models[tag]).inc(count)

    def _tag(self, model: str) -> int:
        tag = self._model_tags.get(model)
        if tag is None:
            with self._tags_lock:
                tag = self._model_tags.get(model)
                if tag is None:
                    tag = len(self._tag_models)
                    self._tag_models.append(model)
                    self._model_tags[model] = tag
        return tag
