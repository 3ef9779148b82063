"""The scheduler: candidates -> filters -> weighted scores -> pods ordered best first.

total(pod) = sum(weight * score) over the score plugins (each score 0..100); ties are
broken randomly so that equal pods share the load. The scheduler does no I/O.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from extproc.errors import ModelNotFound, NoCapacity, NoReadyPods
from extproc.scheduling.types import Cycle, Filter, PodsListener, Recorder, Scorer
from extproc.types import Pod, PodId

log = logging.getLogger("extproc.scheduling")


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: int


@dataclass(slots=True)
class Scheduler:
    """A configured profile: filters and weighted scorers, plus the plugins that learn."""

    filters: tuple[Filter, ...] = ()
    scorers: tuple[WeightedScorer, ...] = ()
    recorders: tuple[Recorder, ...] = ()
    listeners: tuple[PodsListener, ...] = ()
    rng: random.Random = field(default_factory=random.Random)

    def schedule(self, cycle: Cycle, pods: Sequence[Pod]) -> list[Pod]:
        """Rank the pods that may serve ``cycle``'s model, best first.

        Raises:
            ModelNotFound: no pod serves the model.
            NoReadyPods: pods serve the model but none is ready.
            NoCapacity: the filters removed every ready pod.
        """
        candidates: Sequence[Pod] = select_candidates(cycle.request.model, pods)
        for f in self.filters:
            candidates = f.filter(cycle, candidates)
            if not candidates:
                raise NoCapacity(
                    f"no pod can take the request now: filter {f.type_name!r} removed "
                    f"every pod serving model {cycle.request.model!r}"
                )
        totals = dict.fromkeys((p.id for p in candidates), 0)
        verbose = log.isEnabledFor(logging.DEBUG)
        for ws in self.scorers:
            scores = ws.scorer.score(cycle, candidates)
            for pod_id, score in scores.items():
                totals[pod_id] += ws.weight * score
            if verbose:
                _log_scores(ws.scorer.type_name, candidates, scores)
        return rank(candidates, totals, self.rng)

    def record(self, cycle: Cycle, pod: PodId) -> None:
        """The response from ``pod`` ended successfully: let the plugins learn."""
        for recorder in self.recorders:
            recorder.record(cycle, pod)

    def pods_changed(self, pods: Sequence[Pod]) -> None:
        for listener in self.listeners:
            listener.pods_changed(pods)


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


def rank(pods: Sequence[Pod], totals: dict[PodId, int], rng: random.Random) -> list[Pod]:
    """Pods by total score, best first; equal totals in random order."""
    tiebreak = {p.id: rng.random() for p in pods}
    return sorted(pods, key=lambda p: (-totals[p.id], tiebreak[p.id]))


def _log_scores(name: str, pods: Sequence[Pod], scores: Mapping[PodId, int]) -> None:
    """Kthena's ``--v=4`` lines: the plugin, then one line per candidate pod."""
    log.debug("ScorePlugin: %s", name)
    for pod in pods:
        log.debug("Pod: %s, Score: %d", pod.id, scores.get(pod.id, 0))
