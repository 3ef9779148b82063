"""Routing policies for the offline simulator, all seeing pods as a router does.

A policy gets the scraped ``Pod`` snapshot (``PodMetrics``: waiting, running, kv_usage)
and the parsed ``InferenceRequest``; it never reads an engine. ``pick`` returns the index
of the chosen pod; ``finished`` is called once per picked request, ``ok=True`` when its
response ended successfully (only then do policies that learn record the prompt, as the
real server does) and ``ok=False`` when the pod refused it.

* ``round-robin``: pods in turn.
* ``least-request``: fewest ``running + waiting``; ties by a seeded rng.
* ``prefix-affinity``: pure longest prefix match, load ignored: the router's prefix view
  (below) with top-K = 1; with no match anywhere, the prompt's "home" pod
  ``first block hash mod N``, so one prefix always lands on one pod.
* ``prefix-cache``: extproc's real ``Scheduler`` from a configuration (the prefix-cache
  plugin with its weights, the scheduler's own ranking), ties by a seeded rng.
* ``peer-cache-aware``: the peers' ``cache_aware`` policy (sglang-router, vllm-router, as
  ``bench.routing_quality`` runs them: cache threshold 0.3, balance thresholds 64 / 1.5),
  to compare with offline. Load is the router's own count of its requests in flight per
  pod. When the load is imbalanced (max - min > 64 and max > 1.5 x min) the least loaded
  pod; else, when the longest match covers more than 0.3 of the prompt, that pod;
  else the pod holding the fewest cached blocks. The prompt is inserted at pick (the peers
  do not wait for success); their character radix tree is approximated by 64-byte blocks,
  unbounded (the peers' default tree holds 2^26 characters a pod).
* ``cost-aware``: the least estimated time to first token, from the router's view only::

      hit     = min(matched blocks * B / BYTES_PER_TOKEN, prompt tokens - 1)
      own     = prompt tokens - hit                       (prompt tokens = bytes / 4)
      queued  = sum of ``own`` of the pod's newest ``waiting`` unfinished requests
      step(n) = the engine's profile.step_s(n prefill tokens of one request,
                                            running decodes) * time_scale
      TTFT    = full * step(max_num_batched_tokens) + step(rest)
                where queued + own = full * max_num_batched_tokens + rest

  i.e. the queue's prefill tokens then our own, in chunks of the step's token budget,
  each step also decoding the running batch. The profile is the engine's (a router
  calibrated on the pods).
  Assumptions: FCFS, so the waiting requests are the newest ones sent; a running request
  is past its prefill (the rest of the step in progress is ignored: a per-pod "busy
  until" clock that counted it did not predict better in the burst and chat runs);
  waiting for free KV blocks or for ``max_num_seqs`` shows only through the queue.

The prefix view (``PrefixView``) is the router's own record of what it sent where, an
``extproc.prefix.index.PrefixIndex`` over the whole prompt in ``B = 64``-byte blocks,
recorded after success; its per-pod size is the engine's KV capacity in blocks of text::

    entries per pod = num_gpu_blocks * block_size * BYTES_PER_TOKEN / B
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from typing import ClassVar, Protocol

from prometheus_client import CollectorRegistry

from extproc.pods import Pod, PodId
from extproc.prefix.hashing import Keys
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.config import SchedulerConfig, build_scheduler
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import BYTES_PER_TOKEN, Cycle
from extproc.sim.engine import EngineConfig
from extproc.sim.timing import StepWork
from extproc.sim.workloads import WorkItem

VIEW_BLOCK_BYTES = 64  # Kthena's default blockSizeToHash
VIEW_MAX_BLOCKS = 4096  # 256 KB of prompt, past any prompt the engines accept by default

POLICY_NAMES = (
    "round-robin",
    "prefix-affinity",
    "least-request",
    "prefix-cache",
    "cost-aware",
    "peer-cache-aware",
)
PEER_CACHE_THRESHOLD = 0.3  # bench/contenders.py's peer flags
PEER_BALANCE_ABS, PEER_BALANCE_REL = 64, 1.5
PEER_TREE_ENTRIES = (1 << 26) // VIEW_BLOCK_BYTES


class Policy(Protocol):
    name: ClassVar[str]

    def pick(self, item: WorkItem, pods: Sequence[Pod]) -> int:
        """The index in ``pods`` of the pod to send ``item`` to."""
        ...

    def finished(self, item: WorkItem, pod_idx: int, ok: bool) -> None:
        """``item``, sent to ``pods[pod_idx]``, ended: successfully or refused."""
        ...


class PrefixView:
    """What the router recorded each pod was sent (module docstring), never engine state."""

    def __init__(self, max_entries_per_pod: int) -> None:
        self.index = PrefixIndex(max_entries_per_pod)

    @classmethod
    def for_engine(cls, engine: EngineConfig) -> PrefixView:
        capacity_bytes = engine.num_gpu_blocks * engine.block_size * BYTES_PER_TOKEN
        return cls(max(1, capacity_bytes // VIEW_BLOCK_BYTES))

    @staticmethod
    def keys(item: WorkItem) -> Keys:
        return Cycle(item.request).block_keys(VIEW_BLOCK_BYTES, VIEW_MAX_BLOCKS)

    def record(self, keys: Keys, pod: PodId) -> None:
        self.index.record(keys, pod)


class RoundRobin:
    name: ClassVar[str] = "round-robin"

    def __init__(self) -> None:
        self._count = 0

    def pick(self, item: WorkItem, pods: Sequence[Pod]) -> int:
        self._count += 1
        return (self._count - 1) % len(pods)

    def finished(self, item: WorkItem, pod_idx: int, ok: bool) -> None:
        return None


class LeastRequest:
    name: ClassVar[str] = "least-request"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def pick(self, item: WorkItem, pods: Sequence[Pod]) -> int:
        load = [p.metrics.running + p.metrics.waiting for p in pods]
        return min(range(len(pods)), key=lambda i: (load[i], self._rng.random()))

    def finished(self, item: WorkItem, pod_idx: int, ok: bool) -> None:
        return None


class _Learning:
    """Keeps each request's prefix keys until it ends, and records them on success."""

    def __init__(self, view: PrefixView) -> None:
        self.view = view
        self._keys: dict[str, Keys] = {}
        self._pod_ids: list[PodId] = []
        self._pod_idx: dict[PodId, int] = {}

    def _remember(self, item: WorkItem, keys: Keys, pods: Sequence[Pod]) -> None:
        self._keys[item.request_id] = keys
        if len(self._pod_ids) != len(pods):
            self._pod_ids = [p.id for p in pods]
            self._pod_idx = {pod_id: i for i, pod_id in enumerate(self._pod_ids)}

    def finished(self, item: WorkItem, pod_idx: int, ok: bool) -> None:
        keys = self._keys.pop(item.request_id)
        if ok:
            self.view.record(keys, self._pod_ids[pod_idx])


class PrefixAffinity(_Learning):
    name: ClassVar[str] = "prefix-affinity"

    def pick(self, item: WorkItem, pods: Sequence[Pod]) -> int:
        keys = self.view.keys(item)
        self._remember(item, keys, pods)
        best = self.view.index.match(keys, self._pod_ids, 1)
        if best:
            return self._pod_idx[next(iter(best))]
        return int(keys[0]) % len(pods) if len(keys) else 0


class CostAware(_Learning):
    name: ClassVar[str] = "cost-aware"

    def __init__(self, view: PrefixView, engine: EngineConfig, seed: int) -> None:
        super().__init__(view)
        self.engine = engine
        self._rng = random.Random(seed)
        # Per pod, its unfinished requests in arrival order -> their estimated uncached tokens.
        self._own: list[dict[str, int]] = []

    def estimate_ttft_s(self, pod: Pod, pod_idx: int, own: int) -> float:
        """The module docstring's TTFT estimate for ``own`` uncached tokens on ``pod``."""
        cfg, unfinished = self.engine, self._own[pod_idx]
        num_waiting = min(pod.metrics.waiting, len(unfinished))
        queued = sum(itertools.islice(reversed(unfinished.values()), num_waiting))
        profile, running = cfg.profile(), pod.metrics.running
        full, rest = divmod(queued + own, cfg.max_num_batched_tokens)
        ttft_s = full * profile.step_s(StepWork(cfg.max_num_batched_tokens, running, 0, 1))
        if rest:
            ttft_s += profile.step_s(StepWork(rest, running, 0, 1))
        return ttft_s * cfg.time_scale

    def pick(self, item: WorkItem, pods: Sequence[Pod]) -> int:
        keys = self.view.keys(item)
        self._remember(item, keys, pods)
        if len(self._own) != len(pods):
            self._own = [{} for _ in pods]
        matches = self.view.index.match(keys, self._pod_ids, len(pods))
        num_tokens = math.ceil(len(item.request.prompt.encode()) / BYTES_PER_TOKEN)
        own = [
            num_tokens
            - min(matches.get(p.id, 0) * VIEW_BLOCK_BYTES // BYTES_PER_TOKEN, num_tokens - 1)
            for p in pods
        ]
        ttft = [self.estimate_ttft_s(p, i, own[i]) for i, p in enumerate(pods)]
        best = min(range(len(pods)), key=lambda i: (ttft[i], self._rng.random()))
        self._own[best][item.request_id] = own[best]
        return best

    def finished(self, item: WorkItem, pod_idx: int, ok: bool) -> None:
        del self._own[pod_idx][item.request_id]
        super().finished(item, pod_idx, ok)


class PeerCacheAware(_Learning):
    name: ClassVar[str] = "peer-cache-aware"

    def __init__(self, seed: int) -> None:
        super().__init__(PrefixView(PEER_TREE_ENTRIES))
        self._rng = random.Random(seed)
        self._load: list[int] = []

    def pick(self, item: WorkItem, pods: Sequence[Pod]) -> int:
        keys = self.view.keys(item)
        self._remember(item, keys, pods)
        if len(self._load) != len(pods):
            self._load = [0] * len(pods)
        load, index = self._load, self.view.index
        if max(load) - min(load) > PEER_BALANCE_ABS and max(load) > PEER_BALANCE_REL * min(load):
            best = min(range(len(pods)), key=lambda i: (load[i], self._rng.random()))
        else:
            matches = index.match(keys, self._pod_ids, 1)
            if matches and max(matches.values()) > PEER_CACHE_THRESHOLD * len(keys):
                best = self._pod_idx[next(iter(matches))]
            else:
                size = [index.num_pod_entries(p) for p in self._pod_ids]
                best = min(range(len(pods)), key=lambda i: (size[i], self._rng.random()))
        self._load[best] += 1
        index.record(keys, self._pod_ids[best])
        return best

    def finished(self, item: WorkItem, pod_idx: int, ok: bool) -> None:
        self._load[pod_idx] -= 1
        self._keys.pop(item.request_id)


class PrefixCachePolicy:
    """extproc's configured scheduler; ``pick`` is its best-ranked pod.

    Like the server's router, it counts each request in flight on its pick (with the
    prefill tokens the plugins estimated), with its prompt arriving there, until it
    finishes.
    """

    name: ClassVar[str] = "prefix-cache"

    def __init__(self, config: SchedulerConfig, seed: int) -> None:
        self.in_flight = InFlight()
        self.scheduler = build_scheduler(config, CollectorRegistry(), self.in_flight)
        self.scheduler.rng = random.Random(seed)
        self._cycles: dict[str, tuple[Cycle, int]] = {}
        self._pod_ids: list[PodId] = []
        self._pod_idx: dict[PodId, int] = {}

    def pick(self, item: WorkItem, pods: Sequence[Pod]) -> int:
        if len(self._pod_ids) != len(pods):
            self._pod_ids = [p.id for p in pods]
            self._pod_idx = {pod_id: i for i, pod_id in enumerate(self._pod_ids)}
            self.scheduler.pods_changed(pods)
        cycle = Cycle(item.request)
        pick = self.scheduler.schedule(cycle, pods)[0].id
        tokens = cycle.num_prefill_tokens(pick)
        self.in_flight.start(pick, tokens)
        self.scheduler.arriving(cycle, pick)
        self._cycles[item.request_id] = (cycle, tokens)
        return self._pod_idx[pick]

    def finished(self, item: WorkItem, pod_idx: int, ok: bool) -> None:
        cycle, tokens = self._cycles.pop(item.request_id)
        self.in_flight.end(self._pod_ids[pod_idx], tokens)
        self.scheduler.settled(cycle, self._pod_ids[pod_idx])
        if ok:
            self.scheduler.record(cycle, self._pod_ids[pod_idx])


def make_policy(
    name: str, *, scheduler_config: SchedulerConfig, engine: EngineConfig, seed: int
) -> Policy:
    """A fresh policy named as in ``POLICY_NAMES``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "round-robin":
        return RoundRobin()
    if name == "least-request":
        return LeastRequest(seed)
    if name == "prefix-affinity":
        return PrefixAffinity(PrefixView.for_engine(engine))
    if name == "cost-aware":
        return CostAware(PrefixView.for_engine(engine), engine, seed)
    if name == "prefix-cache":
        return PrefixCachePolicy(scheduler_config, seed)
    if name == "peer-cache-aware":
        return PeerCacheAware(seed)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
