"""estimated-ttft (Score, ours; the shipped default): the pod expected to answer first.

The prefix-reuse cost model (``reference/prefix-reuse-lab.txt``): a request's time to
first token on a pod is the wait behind the work queued there plus the prefill of the
prompt tokens the pod does not hold. Per candidate pod::

    matched  = prompt tokens the pod holds: its longest recorded or arriving prefix
    uncached = prompt tokens - matched
    queued   = waiting + max(0, in_flight - waiting - running)   (as least-request)
    ahead    = queued * (in-flight prefill tokens / in-flight requests)
    est_ms   = prefillMsPerToken * (ahead + uncached)
             + queuedMs * (1 + queued) + runningMs * running

``in_flight`` and its tokens are the router's own counters (``InFlight``), so a burst
routed between two scrapes is seen at once; ``waiting``/``running`` are scraped.

Cache turnover: what a pick prefills it writes into the pod's cache, evicting older
prefixes there. ``written`` is each pod's uncached tokens picked there, decayed by
``1 - 1/writtenWindow`` a pick (``Written``), and a pod pays for adding to the busiest
writer's turnover::

    write_ms = writtenMs * (uncached / prompt tokens) * (written / max written)

so new prompts go where the caches turn over slowest and the pods' caches hold their
prefixes alike long (the peers send unmatched prompts to the pod with the smallest
tree); a request mostly held by its pod adds little there, so affinity is untouched.

Hysteresis: the pods holding the longest match (the affinity pods) keep the request
until one is clearly worse than the best other pod, like the peers' balance thresholds:
it yields only when its estimate exceeds the other's by more than ``affinityMarginMs``
*and* by more than ``affinityRatio`` times. With ``est = est_ms + write_ms``, the
affinity pods are ranked by::

    cost = min(est - affinityMarginMs, est / affinityRatio)

and every other pod by ``est``. No pod has affinity when the longest match covers less
than ``affinityMinMatch`` of the prompt (a shared system prompt alone must not pin every
conversation to one pod); ``score = floor(100 * (max_cost - cost) / (max_cost
- min_cost))`` (all 100 when equal). Ties are the scheduler's (least loaded first).

The prefix view is this plugin's own per-pod LRU (``PrefixIndex``, Kthena's block hashing
and eviction), recorded on success only. Between the pick and the end of a request its
blocks are *arriving* at the picked pod (``Arrivals``): they count as held there for the
next requests' scoring and are dropped when the request ends, however it ends; success
then records them in the index for the pod that served. Side output:
``cycle.uncached_tokens`` for every candidate, which the router passes to
``InFlight.start`` for its pick.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar

from prometheus_client import Gauge

from extproc.prefix.hashing import Keys
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.args import load_args
from extproc.scheduling.queue import pod_work
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
    affinityMinMatch: float = 0.3  # no affinity for a match under this share of the prompt
    writtenMs: float = 300.0  # the most a pod's recent cache writes add to its cost ...
    writtenWindow: int = 1000  # ... counted over about this many picks (decayed)


class Arrivals:
    """Prompt blocks on their way to a pod: picked, not ended yet. Thread-safe.

    ``owners[key]`` counts, per pod, the routed requests whose prompt has block ``key``.
    A lookup walks the prompt from its last block back; hashes are chained, so a pod's
    first hit is its longest arriving prefix (at most one dict probe a block).
    """

    def __init__(self) -> None:
        self._owners: dict[int, Counter[PodId]] = {}
        self._lock = threading.Lock()
        self.num_requests = 0  # credited now: ``add`` calls less ``remove`` calls

    def __len__(self) -> int:
        return len(self._owners)

    def add(self, keys: Keys, pod: PodId) -> None:
        with self._lock:
            self.num_requests += 1
            for key in keys.tolist():
                self._owners.setdefault(key, Counter())[pod] += 1

    def remove(self, keys: Keys, pod: PodId) -> None:
        with self._lock:
            self.num_requests -= 1
            for key in keys.tolist():
                owners = self._owners.get(key)
                if owners is None or owners[pod] <= 0:
                    continue
                owners[pod] -= 1
                if owners[pod] <= 0:
                    del owners[pod]
                    if not owners:
                        del self._owners[key]

    def match(self, keys: Keys) -> dict[PodId, int]:
        """Longest arriving prefix, in blocks, per pod with one."""
        found: dict[PodId, int] = {}
        if not self._owners:
            return found
        with self._lock:
            as_list = keys.tolist()
            for i in range(len(as_list) - 1, -1, -1):
                owners = self._owners.get(as_list[i])
                if owners:
                    for pod in owners:
                        found.setdefault(pod, i + 1)
        return found

    def forget_pods(self, keep: set[PodId]) -> None:
        with self._lock:
            for key in list(self._owners):
                owners = self._owners[key]
                for pod in [p for p in owners if p not in keep]:
                    del owners[pod]
                if not owners:
                    del self._owners[key]


class Written:
    """Uncached prompt tokens each pod was picked to prefill (so to write into its cache),
    decayed by ``1 - 1/window`` at every pick. Thread-safe."""

    def __init__(self, window: int) -> None:
        self.decay = 1.0 - 1.0 / window
        self.tick = 0
        self._pods: dict[PodId, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def add(self, pod: PodId, tokens: int) -> None:
        with self._lock:
            self.tick += 1
            value, at = self._pods.get(pod, (0.0, self.tick))
            self._pods[pod] = (value * self.decay ** (self.tick - at) + tokens, self.tick)

    def get(self, pod: PodId) -> float:
        with self._lock:
            value, at = self._pods.get(pod, (0.0, self.tick))
            return value * self.decay ** (self.tick - at)

    def forget_pods(self, keep: set[PodId]) -> None:
        with self._lock:
            self._pods = {pod: v for pod, v in self._pods.items() if pod in keep}


class EstimatedTTFT:
    """Scores pods by estimated time to first token, with affinity hysteresis."""

    type_name: ClassVar[str] = "estimated-ttft"

    def __init__(self, args: EstimatedTTFTArgs, ctx: PluginContext) -> None:
        self.args = args
        self.in_flight = ctx.in_flight
        self.index = PrefixIndex(args.maxHashCacheSize)
        self.arrivals = Arrivals()
        self.written = Written(args.writtenWindow)
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

    def _keys(self, cycle: Cycle) -> Keys:
        return cycle.block_keys(self.args.blockSizeToHash, self.args.maxBlocksToMatch)

    def matched_blocks(self, cycle: Cycle, pods: Sequence[Pod]) -> dict[PodId, int]:
        """Per pod, the longest prefix it holds or has arriving, in blocks."""
        keys = self._keys(cycle)
        if not len(keys):
            return {}
        held = self.index.match(keys, [p.id for p in pods], len(pods))
        for pod, blocks in self.arrivals.match(keys).items():
            if blocks > held.get(pod, 0):
                held[pod] = blocks
        return held

    def matched_bytes(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        """``PrefixMatcher``: bytes of the prompt's start each pod holds (or will)."""
        size, limit = self.args.blockSizeToHash, cycle.num_prompt_bytes
        return {
            pod: min(blocks * size, limit)
            for pod, blocks in self.matched_blocks(cycle, pods).items()
        }

    def estimate_ms(self, cycle: Cycle, pods: Sequence[Pod]) -> dict[PodId, float]:
        """Each pod's ``est_ms`` (module doc); records ``cycle.uncached_tokens``."""
        held = self.matched_bytes(cycle, pods)
        a = self.args
        estimates: dict[PodId, float] = {}
        for pod in pods:
            work = pod_work(cycle, pod, held.get(pod.id, 0), self.in_flight)
            estimates[pod.id] = (
                a.prefillMsPerToken * (work.queued * work.mean_tokens + work.uncached)
                + a.queuedMs * (1 + work.queued)
                + a.runningMs * pod.metrics.running
            )
        return estimates

    def write_ms(self, cycle: Cycle, pods: Iterable[PodId]) -> dict[PodId, float]:
        """Each pod's ``write_ms`` (module doc); needs ``estimate_ms`` run on the cycle."""
        written = {pod: self.written.get(pod) for pod in pods}
        most = max(written.values(), default=0.0)
        if most <= 0:
            return dict.fromkeys(written, 0.0)
        per_token = self.args.writtenMs / (most * max(1, cycle.num_prompt_tokens))
        return {pod: per_token * w * cycle.num_prefill_tokens(pod) for pod, w in written.items()}

    def costs(self, cycle: Cycle, pods: Sequence[Pod]) -> dict[PodId, float]:
        """``est_ms + write_ms`` with the affinity pods' hysteresis applied (module doc)."""
        estimates = self.estimate_ms(cycle, pods)
        for pod, ms in self.write_ms(cycle, estimates).items():
            estimates[pod] += ms
        held = {p: n for p, n in self.matched_blocks(cycle, pods).items() if p in estimates}
        longest = max(held.values(), default=0)
        a = self.args
        share = min(longest * a.blockSizeToHash, cycle.num_prompt_bytes) / max(
            1, cycle.num_prompt_bytes
        )
        if longest <= 0 or share < a.affinityMinMatch:
            return estimates
        for pod, blocks in held.items():
            if blocks == longest:
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
        self.written.add(pod, cycle.num_prefill_tokens(pod))
        if len(keys):
            self.arrivals.add(keys, pod)

    def settled(self, cycle: Cycle, pod: PodId) -> None:
        """The request picked for ``pod`` ended (any outcome): its arriving credit goes."""
        keys = self._keys(cycle)
        if len(keys):
            self.arrivals.remove(keys, pod)

    def pods_changed(self, pods: Sequence[Pod]) -> None:
        ids = set(map(attrgetter("id"), pods))
        self.index.retain_pods(ids)
        self.arrivals.forget_pods(ids)
        self.written.forget_pods(ids)
