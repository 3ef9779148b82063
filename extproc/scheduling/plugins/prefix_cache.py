"""prefix-cache (Score): favour pods that were recently sent the same prompt prefix.

Kthena's prefix-cache plugin, to the letter (``kthena-prefix-cache-plugin.txt``):

* inputs: the rendered prompt's chained block hashes (``extproc.prefix.hashing``) and the
  per-pod LRU index of blocks recorded after successful responses;
* score = ``int(float64(matched) / float64(hashed) * 100)`` for at most ``topKMatches``
  pods, found from the longest match down (Kthena's float arithmetic, truncated: 29 of
  50 blocks is 57, not the exact 58, as 0.58 is a shade under it in binary); every other
  candidate scores 0; an empty prompt is not scored;
* record: after a response ended successfully, the prompt's blocks for the serving pod;
* side output (extproc's): when no plugin before it did, the top-K pods' uncached tokens
  as a cost plugin leaves them (``ceil((prompt bytes - held bytes) / 4)``; the other pods
  the whole prompt), so ``Cycle.predicted_cached_tokens`` (the router's
  ``extproc_predicted_cached_tokens_total``) is this view's estimate when no cost plugin
  is configured; a cost plugin scoring after it overrides it;
* shared: it is a ``PrefixMatcher``, which the configuration hands to the plugins that
  ask how much of the prompt each pod holds (cost-aware);
* metrics: ``kthena_router_prefix_cache_match_ratio{model}`` (best pod's fraction, each
  time the plugin scores; Kthena's buckets), ``..._evictions_total{model}`` (counted as
  Kthena counts them, labelled with the evicted entry's model), ``..._entries``
  (``scheduling.plugins.prefix_metrics``, shared with estimated-ttft's view).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar

import numpy as np

from extproc.pods import Pod, PodId
from extproc.prefix.hashing import Keys
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.args import arg, load_args
from extproc.scheduling.interfaces import (
    BYTES_PER_TOKEN,
    Cycle,
    PluginContext,
    RecordTimes,
    Scores,
    ViewState,
)
from extproc.scheduling.plugins.adopt import same_geometry
from extproc.scheduling.plugins.pod_work import uncached_tokens
from extproc.scheduling.plugins.prefix_metrics import prefix_cache_metrics
from extproc.scheduling.plugins.prefix_rows import match_rows, per_row
from extproc.scheduling.podtable import PodTable, Positions, RowValues


@dataclass(frozen=True, slots=True)
class PrefixCacheArgs:
    # field names are the configuration keys
    blockSizeToHash: int = arg(64, "Bytes of the prompt per hashed block.")
    maxBlocksToMatch: int = arg(
        128, "Blocks hashed per prompt: its first blockSizeToHash x maxBlocksToMatch bytes."
    )
    maxHashCacheSize: int = arg(
        50000, "Blocks recorded per pod; beyond, the least recently used are evicted."
    )
    topKMatches: int = arg(
        5, "At most this many pods score, those with the longest match; the others score 0."
    )


# The arguments that shape the view: a reload keeps it only when they are unchanged.
VIEW_ARGS = ("blockSizeToHash", "maxBlocksToMatch", "maxHashCacheSize")


def kthena_score(matched: int, hashed: int) -> int:
    """Kthena's ``int((float64(matched) / float64(hashed)) * 100)``: float division then
    truncation, which is one below the exact floor for some ratios (29 of 50: 57)."""
    return int(matched / hashed * 100)


class PrefixCacheScorer:
    """Scores by recorded prefix match and records served prompts."""

    type_name: ClassVar[str] = "prefix-cache"
    args_type: ClassVar[type[PrefixCacheArgs]] = PrefixCacheArgs

    def __init__(self, args: PrefixCacheArgs, ctx: PluginContext) -> None:
        self.args = args
        self.metrics = prefix_cache_metrics(ctx.registry)
        self.index = PrefixIndex(args.maxHashCacheSize, observer=self.metrics)
        self.recorded = RecordTimes()  # for ``pod_view``

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> PrefixCacheScorer:
        return cls(load_args(cls.args_type, args), ctx)

    def adopt(self, previous: object) -> bool:
        """``Reloadable``: the recorded view, when its geometry is unchanged."""
        if not isinstance(previous, PrefixCacheScorer):
            return False
        if not same_geometry(self.type_name, "prefix view", previous.args, self.args, VIEW_ARGS):
            self.metrics.entries_changed(-previous.index.num_entries)  # no longer held
            return False
        self.index, self.recorded = previous.index, previous.recorded
        return True

    @property
    def block_geometry(self) -> tuple[int, int]:
        """A ``BlockRecorder``: its records are the prompt's keys of this geometry."""
        return self.args.blockSizeToHash, self.args.maxBlocksToMatch

    def _keys(self, cycle: Cycle) -> Keys:
        return cycle.block_keys(self.args.blockSizeToHash, self.args.maxBlocksToMatch)

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        keys = self._keys(cycle)
        if not len(keys):
            return {}
        matches = self.index.match(keys, [p.id for p in pods], self.args.topKMatches)
        if not (cycle.uncached_tokens or cycle.uncached_rows):
            size, num_bytes = self.args.blockSizeToHash, cycle.num_prompt_bytes
            for pod, matched in matches.items():
                cycle.uncached_tokens[pod] = uncached_tokens(cycle, min(matched * size, num_bytes))
        self._observe(cycle, matches, len(keys))
        return {pod: kthena_score(matched, len(keys)) for pod, matched in matches.items()}

    def score_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Scores:
        keys = self._keys(cycle)
        if not len(keys):
            return per_row(table, positions, {})
        matches = match_rows(self.index, keys, table, positions, self.args.topKMatches)
        self._observe(cycle, matches, len(keys))
        matched = per_row(table, positions, matches)
        if not (cycle.uncached_tokens or cycle.uncached_rows):
            num_bytes = cycle.num_prompt_bytes
            held = np.minimum(matched * self.args.blockSizeToHash, num_bytes)
            uncached = -((held - num_bytes) // BYTES_PER_TOKEN)
            cycle.uncached_rows.append(RowValues(table, positions, uncached))
        scores: Scores = (matched / len(keys) * 100).astype(np.int64)  # as ``kthena_score``
        return scores

    def _observe(self, cycle: Cycle, matches: Mapping[PodId, int], num_hashed: int) -> None:
        if cycle.explaining:
            return
        self.metrics.observe_match(
            cycle.request.model, max(matches.values(), default=0), num_hashed
        )

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
        if len(keys):
            self.index.record(keys, pod, self.metrics.model_tag(cycle.request.model))
            self.recorded.mark(pod)

    def pods_changed(self, pods: Sequence[Pod]) -> None:
        self.index.retain_pods(map(attrgetter("id"), pods))
        self.recorded.retain({p.id for p in pods})

    def pod_view(self, pod: PodId) -> ViewState:
        """``ViewInspector``: the blocks recorded for ``pod`` and its last record's age."""
        return ViewState(self.index.num_pod_entries(pod), self.recorded.age(pod))
