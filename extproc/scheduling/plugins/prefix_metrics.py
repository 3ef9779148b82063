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
registry (``prefix_cache_metrics``, made by the first plugin that asks): each plugin
builds its index with it as the index's observer, and with both plugins configured each
observes its own match ratio when it scores, the evictions count both views' and the
entries gauge is their sum.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from functools import cache

from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.plain_metrics import PlainHistogram

MATCH_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)  # Kthena's


class PrefixCacheMetrics:
    """The three series, registered in one registry; the ``IndexObserver`` of every
    index of a view (entries are tagged with their model: ``model_tag``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        match_ratio = PlainHistogram(  # observed on every request: plain numbers
            "kthena_router_prefix_cache_match_ratio",
            "Fraction of the prompt's blocks matched by the best pod, each time a plugin "
            "with a recorded prefix view scores pods (0 is a miss).",
            MATCH_RATIO_BUCKETS,
            registry,
            ("model",),
        )
        self._match_ratio = cache(match_ratio.labels)  # a model's child, made once
        self._evictions = Counter(
            "kthena_router_prefix_cache_evictions",
            "Prefix-cache entries dropped because a pod's list was full.",
            ["model"],
            registry=registry,
        )
        self._entries = Gauge(
            "kthena_router_prefix_cache_entries",
            "Prefix-cache entries currently stored across all pods.",
            registry=registry,
        )
        self._model_tags: dict[str, int] = {}
        self._tag_models: list[str] = []
        self._tags_lock = threading.Lock()

    def observe_match(self, model: str, matched_blocks: int, num_blocks: int) -> None:
        """The best pod matched ``matched_blocks`` of the prompt's ``num_blocks``."""
        self._match_ratio(model).observe(matched_blocks / num_blocks)

    def model_tag(self, model: str) -> int:
        """The tag an index records ``model``'s entries with (its evictions' label)."""
        tag = self._model_tags.get(model)
        if tag is None:
            with self._tags_lock:
                tag = self._model_tags.get(model)
                if tag is None:
                    tag = len(self._tag_models)
                    self._tag_models.append(model)
                    self._model_tags[model] = tag
        return tag

    # IndexObserver

    def entries_changed(self, delta: int) -> None:
        self._entries.inc(delta)

    def evicted(self, by_tag: Mapping[int, int]) -> None:
        for tag, count in by_tag.items():
            self._evictions.labels(self._tag_models[tag]).inc(count)


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, PrefixCacheMetrics] = (
    weakref.WeakKeyDictionary()
)
_BY_REGISTRY_LOCK = threading.Lock()


def prefix_cache_metrics(registry: CollectorRegistry) -> PrefixCacheMetrics:
    """``registry``'s one ``PrefixCacheMetrics``, registered by the first plugin that asks
    (so the series exist only when a plugin keeps a view)."""
    with _BY_REGISTRY_LOCK:
        metrics = _BY_REGISTRY.get(registry)
        if metrics is None:
            metrics = _BY_REGISTRY[registry] = PrefixCacheMetrics(registry)
        return metrics
