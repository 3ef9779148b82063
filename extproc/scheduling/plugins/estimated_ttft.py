"""estimated-ttft (Score, ours; the shipped default): the pod expected to answer first.

The prefix-reuse cost model (``reference/prefix-reuse-lab.txt``): a request's time to
first token on a pod is the wait behind the work queued there plus the prefill of the
prompt tokens the pod does not hold. Per candidate pod::

    matched  = prompt tokens the pod holds: its longest recorded or arriving prefix
               (exact from precise-prefix-cache when configured; see below)
    uncached = prompt tokens - matched
    queued   = waiting + max(0, in_flight - waiting - running)   (as least-request)
    ahead    = queued * (in-flight prefill tokens / in-flight requests)
    est_ms   = prefillMsPerToken * (ahead + uncached)
             + queuedMs * (1 + queued) + runningMs * running

``in_flight`` and its tokens are the router's own counters (``InFlight``), so a burst
routed between two scrapes is seen at once; ``waiting``/``running`` are scraped.

Hysteresis: the pods holding the longest match (the affinity pods) keep the request
until one is clearly worse than the best other pod, like the peers' balance thresholds:
it yields only when its estimate exceeds the other's by more than ``affinityMarginMs``
*and* by more than ``affinityRatio`` times. The affinity pods are ranked by::

    cost = min(est_ms - affinityMarginMs, est_ms / affinityRatio)

and every other pod by ``est_ms``; ``score = floor(100 * (max_cost - cost) / (max_cost
- min_cost))`` (all 100 when equal). Ties are the scheduler's (least loaded first).

The prefix view is this plugin's own per-pod LRU (``PrefixIndex``, Kthena's block hashing
and eviction), recorded on success only, in tokens estimated from bytes
(``uncached = ceil((prompt bytes - held bytes) / 4)``). Between the pick and the end of a
request its blocks are *arriving* at the picked pod (``Arrivals``): they count as held
there for the next requests' scoring and are dropped when the request ends, however it
ends; success then records them in the index for the pod that served.

With ``precise-prefix-cache`` configured too (``PluginContext.exact``), ``matched`` and
the prompt's length are its exact token counts, from the pods' own KV events (with its
own provisional credit for picks whose events have not come yet). Where it has none,
this plugin's view answers, exactly where precise-prefix-cache falls back: every pod of
a request it cannot tokenize (the prompt then in estimated tokens, as above), a pod
whose view is stale (``matched = prompt tokens * held bytes / prompt bytes``, so every
pod of the request is counted in the same tokens).

Side output: ``cycle.uncached_tokens`` for every candidate, which the router passes to
``InFlight.start`` for its pick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar

from prometheus_client import Gauge

from extproc.prefix.hashing import Keys
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.args import load_args
from extproc.scheduling.arrivals import Arrivals
from extproc.scheduling.queue import pod_work, uncached_tokens
from extproc.scheduling.types import Cycle, PluginContext
from extproc.types import Pod, PodId


@dataclass(frozen=True, slots=True)
class EstimatedTTFTArgs:
    blockSizeToHash: int = 64  # bytes a block of the prefix view, as prefix-cache
    maxBlocksToMatch: int = 512  # 32 KB of prompt: long chat histories still tell pods apart
    maxHashCacheSize: int = 50000  # entries per pod
    prefillMsPerToken: float = 0.1  # ms of one step per uncached prompt token
    queuedMs: float = 30.0  # ms each request queued ahead adds beyond its prefill (steps, a slot)
    runningMs: float = 5.0  # ms each running request adds (its decode share of each step)
    affinityMarginMs: float = 50.0  # the affinity pod yields only past this many ms ...
    affinityRatio: float = 1.5  # ... and past this many times the other's estimate


class EstimatedTTFT:
    """Scores pods by estimated time to first token, with affinity hysteresis."""

    type_name: ClassVar[str] = "estimated-ttft"

    def __init__(self, args: EstimatedTTFTArgs, ctx: PluginContext) -> None:
        self.args = args
        self.in_flight = ctx.in_flight
        self.exact = ctx.exact
        self.index = PrefixIndex(args.maxHashCacheSize)
        self.arrivals = Arrivals()
        Gauge(
            "extproc_estimated_ttft_arriving_requests",
            "Routed requests whose prompt counts as arriving at their pick (not ended yet).",
            registry=ctx.registry,
        ).set_function(lambda: self.arrivals.num_requests)
        Gauge(
            "extproc_estimated_ttft_entries",
            "Prefix-view entries (blocks per pod) recorded by estimated-ttft.",
            registry=ctx.registry,
        ).set_function(lambda: self.index.num_entries)

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> EstimatedTTFT:
        return cls(load_args(EstimatedTTFTArgs, args), ctx)

    @property
    def block_geometry(self) -> tuple[int, int]:
        """A ``BlockRecorder``: its records are the prompt's keys of this geometry, so a
        record can travel to the other replicas (reply metadata, Redis)."""
        return self.args.blockSizeToHash, self.args.maxBlocksToMatch

    def _keys(self, cycle: Cycle) -> Keys:
        return cycle.block_keys(self.args.blockSizeToHash, self.args.maxBlocksToMatch)

    def matched_blocks(self, cycle: Cycle, pods: Sequence[Pod]) -> dict[PodId, int]:
        """Per pod, the longest prefix it holds or has arriving, in blocks."""
        keys = self._keys(cycle)
        if not len(keys) or not pods:
            return {}
        held = self.index.match(keys, [p.id for p in pods], len(pods))
        candidates = {p.id for p in pods}
        for pod, blocks in self.arrivals.match(keys.tolist()).items():
            if blocks > held.get(pod, 0) and pod in candidates:
                held[pod] = blocks
        return held

    def matched_bytes(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        """``PrefixMatcher``: bytes of the prompt's start each pod holds (or will)."""
        size, limit = self.args.blockSizeToHash, cycle.num_prompt_bytes
        return {
            pod: min(blocks * size, limit)
            for pod, blocks in self.matched_blocks(cycle, pods).items()
        }

    def prefix_tokens(self, cycle: Cycle, pods: Sequence[Pod]) -> tuple[int, dict[PodId, int]]:
        """The prompt's tokens, and per pod the ones it holds or has arriving (pods
        holding none may be left out): exact where precise-prefix-cache knows, else from
        this plugin's view (module doc)."""
        exact = self.exact.exact_matches(cycle, pods) if self.exact is not None else None
        if exact is None:
            num_tokens = cycle.num_prompt_tokens
            held = self.matched_bytes(cycle, pods)
            return num_tokens, {
                pod: num_tokens - uncached_tokens(cycle, b) for pod, b in held.items()
            }
        num_tokens, matched = exact.num_prompt_tokens, dict(exact.matched_tokens)
        others = [p for p in pods if p.id not in matched]
        if others:
            num_bytes = max(1, cycle.num_prompt_bytes)
            for pod, held_bytes in self.matched_bytes(cycle, others).items():
                matched[pod] = num_tokens * held_bytes // num_bytes
        return num_tokens, matched

    def estimate_ms(self, cycle: Cycle, pods: Sequence[Pod]) -> dict[PodId, float]:
        """Each pod's ``est_ms`` (module doc); records ``cycle.uncached_tokens``."""
        return self._estimate_ms(cycle, pods, *self.prefix_tokens(cycle, pods))

    def _estimate_ms(
        self, cycle: Cycle, pods: Sequence[Pod], num_tokens: int, matched: Mapping[PodId, int]
    ) -> dict[PodId, float]:
        a = self.args
        estimates: dict[PodId, float] = {}
        for pod in pods:
            uncached = num_tokens - matched.get(pod.id, 0)
            work = pod_work(cycle, pod, uncached, self.in_flight, num_tokens)
            estimates[pod.id] = (
                a.prefillMsPerToken * (work.queued * work.mean_tokens + work.uncached)
                + a.queuedMs * (1 + work.queued)
                + a.runningMs * pod.metrics.running
            )
        return estimates

    def costs(self, cycle: Cycle, pods: Sequence[Pod]) -> dict[PodId, float]:
        """``est_ms`` with the affinity pods' hysteresis applied (module doc)."""
        num_tokens, matched = self.prefix_tokens(cycle, pods)
        estimates = self._estimate_ms(cycle, pods, num_tokens, matched)
        longest = max(matched.values(), default=0)
        if longest <= 0:
            return estimates
        a = self.args
        for pod, tokens in matched.items():
            if tokens == longest:
                est = estimates[pod]
                estimates[pod] = min(est - a.affinityMarginMs, est / a.affinityRatio)
        return estimates

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        costs = self.costs(cycle, pods)
        lo, hi = min(costs.values(), default=0.0), max(costs.values(), default=0.0)
        if hi == lo:
            return dict.fromkeys(costs, 100)
        return {pod: int(100 * (hi - cost) / (hi - lo)) for pod, cost in costs.items()}

    def record(self, cycle: Cycle, pod: PodId) -> None:
        keys = self._keys(cycle)
        if len(keys):
            self.index.record(keys, pod)

    def arriving(self, cycle: Cycle, pod: PodId) -> None:
        """``pod`` was picked for ``cycle``: its blocks count as held there until it ends."""
        keys = self._keys(cycle)
        if len(keys):
            self.arrivals.add(keys.tolist(), pod)

    def settled(self, cycle: Cycle, pod: PodId) -> None:
        """The request picked for ``pod`` ended (any outcome): its arriving credit goes."""
        keys = self._keys(cycle)
        if len(keys):
            self.arrivals.remove(keys.tolist(), pod)

    def pods_changed(self, pods: Sequence[Pod]) -> None:
        ids = set(map(attrgetter("id"), pods))
        self.index.retain_pods(ids)
        self.arrivals.forget_pods(ids)
