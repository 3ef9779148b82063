"""Offline routing simulation: a workload through N engines under one policy, no network.

A discrete-event loop on a virtual clock. For each arrival, in time order, at time t:

1. every engine whose last step ended before t runs steps until one ends at or after t
   (``Engine.advance_to``); a step that starts before t runs whole, as in vLLM, so its
   outputs may lie after t;
2. completions with ``finished_s <= t`` are delivered to the policy, oldest first (ties
   by pod index); later ones wait in a heap, so no policy ever learns of a response
   before it ended;
3. pods are "scraped" (``PodMetrics`` from ``Engine.stats()``: waiting, running,
   kv_usage; the KV capacity its ``vllm:cache_config_info`` shows; with LoRA on, the
   adapters ``vllm:lora_requests_info`` would name) if ``scrape_interval_s`` has passed since the last scrape (0: every
   arrival; an engine that neither stepped nor got a request since keeps its metrics).
   The engine's counts are those after its last step, which may end after t; requests
   finishing at that step's end are counted as still running (admission happened at
   the step's start, so waiting is already right; kv_usage is left as after the step).
   Then the policy picks a pod and the request is added to its engine at t.
   A request the engine refuses (too large, queue full) is counted as rejected and
   reported to the policy as failed.

After the last arrival every engine runs until idle and the rest is delivered.

Results: per request its pod, TTFT and end; per pod the engine's counters
(prefix-cache queries and hits in tokens, evicted blocks, adapter loads) and how many
requests it got.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.errors import ExtProcError
from extproc.pods import LoraSlots, Pod, PodId, PodMetrics
from extproc.scheduling.config import SchedulerConfig
from extproc.sim.engine import Engine, EngineConfig, FinishedRequest, RequestRejected
from extproc.sim.policies import Policy, make_policy
from extproc.sim.workloads import WorkItem, Workload

POD_NAMESPACE = "sim"


@dataclass(frozen=True, slots=True)
class SimSettings:
    num_pods: int
    engine: EngineConfig
    scrape_interval_s: float = 0.0  # 0: fresh metrics at every arrival

    def __post_init__(self) -> None:
        if self.num_pods <= 0:
            raise ValueError(f"num_pods must be > 0, got {self.num_pods}")
        if not self.scrape_interval_s >= 0.0:
            raise ValueError(f"scrape_interval_s must be >= 0, got {self.scrape_interval_s}")


@dataclass(frozen=True, slots=True)
class RequestResult:
    request_id: str
    pod_idx: int
    ttft_s: float
    finished_s: float
    queue_s: float = 0.0  # arrival to the step that first admitted it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # its prefix-cache hit at that admission


@dataclass(frozen=True, slots=True)
class PodResult:
    name: str
    num_requests: int  # routed to it, rejected ones included
    num_rejected: int
    prefix_cache_queries: int  # tokens looked up at first admissions (vLLM's counter)
    prefix_cache_hits: int  # of those, tokens found in its prefix cache
    num_evicted_blocks: int
    num_lora_loads: int = 0  # adapters brought into a GPU slot


@dataclass(frozen=True, slots=True)
class RunResult:
    policy: str
    requests: tuple[RequestResult, ...]  # finished requests, in completion order
    pods: tuple[PodResult, ...]
    wall_s: float  # real time the run took; not part of the deterministic report
    num_refused: int = 0  # answered by the router itself (429: the filters left no pod)


def make_pods(num_pods: int, model: str, adapters: Sequence[str] = ()) -> list[Pod]:
    """Pods serving ``model`` and the LoRA ``adapters`` on it."""
    return [
        Pod(
            id=PodId(POD_NAMESPACE, f"pod-{i}"),
            address=f"127.0.0.1:{8000 + i}",
            models=frozenset({model, *adapters}),
            adapters=frozenset(adapters),
        )
        for i in range(num_pods)
    ]


def scrape(pod: Pod, engine: Engine, num_finishing: int) -> Pod:
    """``pod`` with the metrics its engine would export now.

    ``num_finishing`` requests end with the step in progress: still running now.
    """
    stats = engine.stats()
    running = stats.num_running + num_finishing
    cfg = engine.config
    lora = None
    if cfg.enable_lora:  # vLLM 0.32 names the same adapters in both labels
        names = frozenset(engine.lora_request_states())
        lora = LoraSlots(running=names, waiting=names, max_lora=cfg.max_loras)
    metrics = PodMetrics(
        stats.num_waiting,
        running,
        stats.kv_cache_usage,
        kv_capacity_tokens=cfg.num_gpu_blocks * cfg.block_size,
        lora=lora,
    )
    return Pod(pod.id, pod.address, pod.models, pod.adapters, metrics=metrics)


class _Replay:
    """One run's state: engines, undelivered completions, the last scrape, the counters."""

    def __init__(
        self, policy: Policy, settings: SimSettings, model: str, adapters: Sequence[str]
    ) -> None:
        self.policy = policy
        self.settings = settings
        self.engines = [Engine(settings.engine) for _ in range(settings.num_pods)]
        self.base_pods = make_pods(settings.num_pods, model, adapters)
        self.pods = tuple(self.base_pods)
        # Engine state moved since its last scrape; the first scrape reads every pod.
        self.changed = [True] * settings.num_pods
        # Requests whose last token comes at the end of the engine's step in progress.
        self.finishing = [0] * settings.num_pods
        self.next_scrape_s = -math.inf
        self.num_routed = [0] * settings.num_pods
        self.num_rejected = [0] * settings.num_pods
        self.num_refused = 0
        self.in_flight: dict[str, WorkItem] = {}
        self.results: list[RequestResult] = []
        # (finish time, pod index, sequence, request): delivered oldest first.
        self._heap: list[tuple[float, int, int, FinishedRequest]] = []
        self._seq = 0

    def advance(self, t: float) -> None:
        """Step every engine until its last step ends at or after ``t``; queue completions."""
        for pod_idx, engine in enumerate(self.engines):
            if self.finishing[pod_idx] and engine.clock <= t:
                self.finishing[pod_idx] = 0  # that step has ended by now
                self.changed[pod_idx] = True
            if engine.clock >= t or not engine.has_work():
                continue
            results = engine.advance_to(t)
            if not results:
                continue
            self.changed[pod_idx] = True
            last = results[-1]
            self.finishing[pod_idx] = len(last.finished) if last.end_s > t else 0
            for result in results:
                for fin in result.finished:
                    self._seq += 1
                    heapq.heappush(self._heap, (fin.finished_s, pod_idx, self._seq, fin))

    def deliver(self, t: float) -> None:
        """Tell the policy of every response that ended at or before ``t``, oldest first."""
        heap = self._heap
        while heap and heap[0][0] <= t:
            _, pod_idx, _, fin = heapq.heappop(heap)
            self.policy.finished(self.in_flight.pop(fin.request_id), pod_idx, True)
            self.results.append(
                RequestResult(
                    fin.request_id,
                    pod_idx,
                    fin.ttft_s,
                    fin.finished_s,
                    fin.queue_s,
                    fin.num_prompt_tokens,
                    fin.num_cached_tokens,
                )
            )

    def scrape_if_due(self, t: float) -> None:
        """Refresh the metrics of the pods whose engines changed, if the interval passed."""
        if t < self.next_scrape_s:
            return
        self.next_scrape_s = t + self.settings.scrape_interval_s
        if any(self.changed):
            pods = list(self.pods)
            for pod_idx, engine in enumerate(self.engines):
                if self.changed[pod_idx]:
                    pods[pod_idx] = scrape(self.base_pods[pod_idx], engine, self.finishing[pod_idx])
                    self.changed[pod_idx] = False
            self.pods = tuple(pods)

    def route(self, item: WorkItem) -> None:
        try:
            pod_idx = self.policy.pick(item, self.pods)
        except ExtProcError:  # as the server would: the client gets the error, no pod
            self.num_refused += 1
            return
        self.num_routed[pod_idx] += 1
        self.changed[pod_idx] = True
        try:
            self.engines[pod_idx].add_request(item.sim, item.arrival_s)
        except RequestRejected:
            self.num_rejected[pod_idx] += 1
            self.policy.finished(item, pod_idx, False)
            return
        self.in_flight[item.request_id] = item

    def pod_results(self) -> tuple[PodResult, ...]:
        out: list[PodResult] = []
        for pod_idx, (pod, engine) in enumerate(zip(self.base_pods, self.engines, strict=True)):
            stats = engine.stats()
            out.append(
                PodResult(
                    name=pod.id.name,
                    num_requests=self.num_routed[pod_idx],
                    num_rejected=self.num_rejected[pod_idx],
                    prefix_cache_queries=stats.prefix_cache_queries,
                    prefix_cache_hits=stats.prefix_cache_hits,
                    num_evicted_blocks=stats.num_evicted_blocks,
                    num_lora_loads=stats.num_lora_loads,
                )
            )
        return tuple(out)


def simulate(workload: Workload, policy: Policy, settings: SimSettings) -> RunResult:
    """Replay ``workload`` under ``policy``; see the module docstring."""
    started = time.perf_counter()
    model = str(workload.params.get("model", ""))
    replay = _Replay(policy, settings, model, workload.params.get("adapters", ()))
    for item in workload.items():
        replay.advance(item.arrival_s)
        replay.deliver(item.arrival_s)
        replay.scrape_if_due(item.arrival_s)
        replay.route(item)
    replay.advance(math.inf)
    replay.deliver(math.inf)
    return RunResult(
        policy=policy.name,
        requests=tuple(replay.results),
        pods=replay.pod_results(),
        wall_s=time.perf_counter() - started,
        num_refused=replay.num_refused,
    )


def compare(
    workload: Workload,
    policy_names: Sequence[str],
    settings: SimSettings,
    scheduler_config: SchedulerConfig,
    seed: int = 0,
) -> list[RunResult]:
    """One ``simulate`` per policy, each with fresh engines and a freshly seeded policy."""
    return [
        simulate(
            workload,
            make_policy(name, scheduler_config=scheduler_config, engine=settings.engine, seed=seed),
            settings,
        )
        for name in policy_names
    ]
