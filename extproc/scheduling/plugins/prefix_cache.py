"""prefix-cache (Score): favour pods that were recently sent the same prompt prefix.

Kthena's prefix-cache plugin, to the letter (``kthena-prefix-cache-plugin.txt``):

* inputs: the rendered prompt's chained block hashes (``extproc.prefix.hashing``) and the
  per-pod LRU index of blocks recorded after successful responses;
* score = floor(matched blocks / hashed blocks * 100) for at most ``topKMatches`` pods,
  found from the longest match down; every other candidate scores 0; an empty prompt
  is not scored;
* record: after a response ended successfully, the prompt's blocks for the serving pod;
* shared: it is a ``PrefixMatcher``, which the configuration hands to the plugins that
  ask how much of the prompt each pod holds (cost-aware);
* metrics: ``kthena_router_prefix_cache_match_ratio{model}`` (best pod's fraction, each
  time the plugin scores; Kthena's buckets), ``..._evictions_total{model}`` (counted as
  Kthena counts them, labelled with the evicted entry's model), ``..._entries``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from operator import attrgetter
from typing import Any, ClassVar

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from extproc.prefix.hashing import Keys
from extproc.prefix.index import PodSet, PrefixIndex
from extproc.scheduling.args import load_args
from extproc.scheduling.podtable import PodTable, Positions
from extproc.scheduling.types import Cycle, PluginContext, Scores
from extproc.types import Pod, PodId

MAX_EXCLUDED = 64  # candidates scored as "every pod but these" up to this many left out

MATCH_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)  # Kthena's


@dataclass(frozen=True, slots=True)
class PrefixCacheArgs:
    blockSizeToHash: int = 64  # field names are the configuration keys
    maxBlocksToMatch: int = 128  # 64 * 128 = the first 8,192 bytes
    maxHashCacheSize: int = 50000  # entries per pod (~390 distinct 8 KB prompts)
    topKMatches: int = 5


class PrefixCacheScorer:
    """Scores by recorded prefix match and records served prompts."""

    type_name: ClassVar[str] = "prefix-cache"

    def __init__(self, args: PrefixCacheArgs, ctx: PluginContext) -> None:
        self.args = args
        self.index = PrefixIndex(args.maxHashCacheSize)
        match_ratio = Histogram(
            "kthena_router_prefix_cache_match_ratio",
            "Fraction of the prompt's blocks matched by the best pod, each time the "
            "prefix-cache plugin scores pods (0 is a miss).",
            ["model"],
            registry=ctx.registry,
            buckets=MATCH_RATIO_BUCKETS,
        )
        self._match_ratio = cache(match_ratio.labels)  # a model's child, made once
        self._evictions = Counter(
            "kthena_router_prefix_cache_evictions",
            "Prefix-cache entries dropped because a pod's list was full.",
            ["model"],
            registry=ctx.registry,
        )
        entries = Gauge(
            "kthena_router_prefix_cache_entries",
            "Prefix-cache entries currently stored across all pods.",
            registry=ctx.registry,
        )
        entries.set_function(lambda: self.index.num_entries)
        self._model_tags: dict[str, int] = {}  # index entries are tagged with their model
        self._tag_models: list[str] = []
        self._tags_lock = threading.Lock()

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> PrefixCacheScorer:
        return cls(load_args(PrefixCacheArgs, args), ctx)

    @property
    def block_geometry(self) -> tuple[int, int]:
        """A ``BlockRecorder``: its records are the prompt's keys of this geometry."""
        return self.args.blockSizeToHash, self.args.maxBlocksToMatch

    def _keys(self, cycle: Cycle) -> Keys:
        return cycle.block_keys(self.args.blockSizeToHash, self.args.maxBlocksToMatch)

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        return self._score(cycle, [p.id for p in pods])

    def score_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Scores:
        out = np.zeros(len(positions), dtype=np.int64)
        # The candidates' slot masks, kept while the snapshots list the same pods (PodSet):
        # every pod's, less the few rows left out (the filters change with each snapshot's
        # metrics), else those of exactly these rows.
        num_excluded = len(table) - len(positions)
        exclude: list[PodId] = []
        if num_excluded <= max(MAX_EXCLUDED, len(positions) // 8):
            pod_set = table.memo((self, "all"), lambda: PodSet(table.ids), rows_only=True)
            if num_excluded:
                excluded = np.ones(len(table), dtype=np.bool_)
                excluded[positions] = False
                exclude = [table.ids[row] for row in np.flatnonzero(excluded).tolist()]
        else:
            pod_set = table.memo(
                (self, positions.tobytes()),
                lambda: PodSet(table.ids[i] for i in positions.tolist()),
                rows_only=True,
            )
        scores = self._score(cycle, pod_set, exclude)
        if scores:  # positions ascend, so each pod's row is found by bisection
            rows = np.fromiter(map(table.position.__getitem__, scores), np.int64, len(scores))
            out[np.searchsorted(positions, rows)] = list(scores.values())
        return out

    def _score(
        self, cycle: Cycle, candidates: Sequence[PodId] | PodSet, exclude: Sequence[PodId] = ()
    ) -> dict[PodId, int]:
        keys = self._keys(cycle)
        if not len(keys):
            return {}
        matches = self.index.match(keys, candidates, self.args.topKMatches, exclude)
        num_hashed = len(keys)
        best = max(matches.values(), default=0)
        self._match_ratio(cycle.request.model).observe(best / num_hashed)
        return {pod: matched * 100 // num_hashed for pod, matched in matches.items()}

    def matched_bytes(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        """Bytes of the prompt's start each pod holds: its matched blocks times the block
        size, at most the prompt (the last block may be short); every pod, not top-K."""
        keys = self._keys(cycle)
        if not len(keys):
            return {}
        matches = self.index.match(keys, [p.id for p in pods], len(pods))
        size, limit = self.args.blockSizeToHash, cycle.num_prompt_bytes
        return {pod: min(matched * size, limit) for pod, matched in matches.items()}

    def record(self, cycle: Cycle, pod: PodId) -> None:
        keys = self._keys(cycle)
        if not len(keys):
            return
        evicted = self.index.record_tagged(keys, pod, self._tag(cycle.request.model))
        for tag, count in evicted.items():
            self._evictions.labels(self._tag_models[tag]).inc(count)

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

    def pods_changed(self, pods: Sequence[Pod]) -> None:
        self.index.retain_pods(map(attrgetter("id"), pods))
