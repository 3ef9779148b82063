"""The scheduler: candidates -> filters -> weighted scores -> pods ordered best first.

total(pod) = sum(weight * score) over the score plugins (each score 0..100); ties are
broken randomly so that equal pods share the load. The scheduler does no I/O.

``schedule_request`` adds what a whole request needs around that pass:

* Prefill/decode disaggregation: when the model has prefill pods and decode pods, the
  decode pods (and ordinary ones) and the prefill pods are filtered and scored in
  separate passes; the request goes to the decode pods best first, and the best prefill
  pod is named in the result (the server sends it on as ``x-prefiller-host-port``).
* Session sticky (``sessions``): a request whose session is bound to a pod (or pair)
  that passes the filters goes there without scoring; the other candidates follow in
  random order as fallbacks. The pod that serves a request successfully is (re)bound,
  and its prompt is recorded even for pinned requests, so that when a binding expires
  the pod matches the conversation's whole history (Kthena records nothing for them).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from extproc.errors import ModelNotFound, NoCapacity, NoReadyPods
from extproc.scheduling.sessions import Binding, SessionStore
from extproc.scheduling.types import Cycle, Filter, PodsListener, Recorder, Scorer
from extproc.types import Pod, PodId, PodRole

log = logging.getLogger("extproc.scheduling")


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: int


PLUGIN_BUCKETS = (0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.005)


class PluginTimer:
    """``extproc_plugin_duration_seconds{plugin, extension_point}``, children made once."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._histogram = Histogram(
            "extproc_plugin_duration_seconds",
            "Time one plugin took for one request, by plugin and extension point (filter, score).",
            ["plugin", "extension_point"],
            registry=registry,
            buckets=PLUGIN_BUCKETS,
        )
        self._children: dict[tuple[str, str], Any] = {}

    def observe(self, plugin: str, point: str, seconds: float) -> None:
        child = self._children.get((plugin, point))
        if child is None:
            child = self._children[(plugin, point)] = self._histogram.labels(plugin, point)
        child.observe(seconds)


@dataclass(frozen=True, slots=True)
class Schedule:
    """Where one request goes."""

    pods: list[Pod]  # best first: the pick, then fallbacks (decode pods with PD)
    prefill: Pod | None = None  # the prefill pod, with prefill/decode disaggregation
    pinned: bool = False  # session sticky: sent to the bound pod without scoring


@dataclass(slots=True)
class Scheduler:
    """A configured profile: filters and weighted scorers, plus the plugins that learn."""

    filters: tuple[Filter, ...] = ()
    scorers: tuple[WeightedScorer, ...] = ()
    recorders: tuple[Recorder, ...] = ()
    listeners: tuple[PodsListener, ...] = ()
    rng: random.Random = field(default_factory=random.Random)
    sessions: SessionStore | None = None
    timer: PluginTimer | None = None

    def schedule(self, cycle: Cycle, pods: Sequence[Pod]) -> list[Pod]:
        """Rank the pods that may serve ``cycle``'s model, best first (one pass).

        Raises:
            ModelNotFound: no pod serves the model.
            NoReadyPods: pods serve the model but none is ready.
            NoCapacity: the filters removed every ready pod.
        """
        candidates = select_candidates(cycle.request.model, pods)
        return self._score(cycle, self._filter(cycle, candidates))

    def schedule_request(self, cycle: Cycle, pods: Sequence[Pod]) -> Schedule:
        """``schedule`` plus prefill/decode passes and session sticky (module doc)."""
        candidates = select_candidates(cycle.request.model, pods)
        prefill = [p for p in candidates if p.role is PodRole.PREFILL]
        serving = [p for p in candidates if p.role is not PodRole.PREFILL]
        if not serving:
            raise NoReadyPods(
                f"model {cycle.request.model!r} has ready prefill pods but no ready decode pod"
            )
        serving = self._filter(cycle, serving)
        prefill = self._filter(cycle, prefill) if prefill else []
        binding = self._binding(cycle)
        if binding is not None:
            bound = _find(serving, binding.pod)
            bound_prefill = _find(prefill, binding.prefill) if binding.prefill else None
            if bound is not None and (bound_prefill is not None or not prefill):
                rest = [p for p in serving if p is not bound]
                self.rng.shuffle(rest)
                return Schedule([bound, *rest], bound_prefill, pinned=True)
        best_prefill = self._score(cycle, prefill)[0] if prefill else None
        return Schedule(self._score(cycle, serving), best_prefill)

    def _binding(self, cycle: Cycle) -> Binding | None:
        key = cycle.request.session_key
        return self.sessions.get(key) if key and self.sessions is not None else None

    def _filter(self, cycle: Cycle, candidates: Sequence[Pod]) -> list[Pod]:
        for f in self.filters:
            started = time.perf_counter()
            candidates = f.filter(cycle, candidates)
            if self.timer is not None:
                self.timer.observe(f.type_name, "filter", time.perf_counter() - started)
            if not candidates:
                raise NoCapacity(
                    f"no pod can take the request now: filter {f.type_name!r} removed "
                    f"every pod serving model {cycle.request.model!r}"
                )
        return list(candidates)

    def _score(self, cycle: Cycle, candidates: Sequence[Pod]) -> list[Pod]:
        totals = dict.fromkeys((p.id for p in candidates), 0)
        verbose = log.isEnabledFor(logging.DEBUG)
        for ws in self.scorers:
            started = time.perf_counter()
            scores = ws.scorer.score(cycle, candidates)
            if self.timer is not None:
                self.timer.observe(ws.scorer.type_name, "score", time.perf_counter() - started)
            for pod_id, score in scores.items():
                totals[pod_id] += ws.weight * score
            if verbose:
                _log_scores(ws.scorer.type_name, candidates, scores)
        return rank(candidates, totals, self.rng)

    def record(self, cycle: Cycle, pod: PodId, prefill: PodId | None = None) -> None:
        """The response from ``pod`` (with ``prefill``) ended successfully: learn.

        Both pods of a prefill/decode pair are recorded; the session is (re)bound.
        """
        for recorder in self.recorders:
            recorder.record(cycle, pod)
            if prefill is not None:
                recorder.record(cycle, prefill)
        key = cycle.request.session_key
        if key and self.sessions is not None:
            self.sessions.bind(key, Binding(pod, prefill))

    def pods_changed(self, pods: Sequence[Pod]) -> None:
        for listener in self.listeners:
            listener.pods_changed(pods)
        if self.sessions is not None:
            self.sessions.forget_pods({p.id for p in pods})


def select_candidates(model: str, pods: Sequence[Pod]) -> list[Pod]:
    """Ready pods serving ``model``; raises when there are none (404 vs 503)."""
    serving = [p for p in pods if model in p.models]
    if not serving:
        raise ModelNotFound(f"the model {model!r} does not exist: no pod serves it")
    ready = [p for p in serving if p.ready]
    if not ready:
        raise NoReadyPods(
            f"no pod serving model {model!r} is ready ({len(serving)} known, none ready)"
        )
    return ready


def _find(pods: Sequence[Pod], pod_id: PodId) -> Pod | None:
    return next((p for p in pods if p.id == pod_id), None)


def rank(pods: Sequence[Pod], totals: dict[PodId, int], rng: random.Random) -> list[Pod]:
    """Pods by total score, best first; equal totals in random order."""
    tiebreak = {p.id: rng.random() for p in pods}
    return sorted(pods, key=lambda p: (-totals[p.id], tiebreak[p.id]))


def _log_scores(name: str, pods: Sequence[Pod], scores: Mapping[PodId, int]) -> None:
    """Kthena's ``--v=4`` lines: the plugin, then one line per candidate pod."""
    log.debug("ScorePlugin: %s", name)
    for pod in pods:
        log.debug("Pod: %s, Score: %d", pod.id, scores.get(pod.id, 0))
