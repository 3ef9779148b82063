"""``PodStore``: the one owner of the pod list the router sees.

Two inputs: the base pods from discovery or the pods file (``set_pods``), and the
scraper's outcomes (``update_metrics``: metrics, and the LoRA adapters read from the
pod's ``/v1/models``). One output: the merged, immutable
``tuple[Pod, ...]`` passed to ``on_change`` (the router's ``set_pods``) whenever it
differs from the last one published, in discovery order, unready pods included (so
plugins keep their state for a pod that is only briefly stale).

A pod is ready iff discovery says so and its metrics are fresh:

* its last successful scrape is at most ``stale_after_s`` old, or, before its first
  one, it was first seen at most ``grace_s`` ago (default ``stale_after_s``);
* and its last scrape did not fail to connect (``reachable=False``): a refused
  connection takes the pod out at once, until a scrape succeeds again. Other failures
  (timeouts, HTTP errors, unparseable pages) keep the last metrics until they go stale.

``stale_after_s=None`` runs without metrics: readiness is discovery's alone.

Adapters: the published pod's ``models`` and ``adapters`` are its base pod's with the
adapters last read from its ``/v1/models`` added (the source's own adapters stay even
when the page does not list them). A read that failed sends nothing, so the last good
list stays; it goes with the pod when discovery drops it.

Publishing is cheap: a pod whose base, metrics and readiness did not change keeps its
``Pod`` object, and nothing is published when no pod changed. Staleness is evaluated
whenever an input arrives; the scraper reports every interval, even when no scrape
finished, so a silent pod goes stale on time. Thread-safe: inputs serialise on a lock
held while ``on_change`` runs, so snapshots are published in order.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from extproc.pods import Pod, PodId, PodMetrics


@dataclass(frozen=True, slots=True)
class MetricsUpdate:
    """One scrape's outcome for one pod."""

    pod_id: PodId
    metrics: PodMetrics | None  # None: the scrape failed
    reachable: bool = True  # False: the connection failed (refused, reset, no route)


@dataclass(frozen=True, slots=True)
class AdaptersUpdate:
    """One successful read of a pod's ``/v1/models``: the LoRA adapters it lists."""

    pod_id: PodId
    adapters: frozenset[str]


@dataclass(slots=True)
class _Health:
    first_seen_s: float
    metrics: PodMetrics = field(default_factory=PodMetrics)
    last_ok_s: float | None = None
    reachable: bool = True
    adapters: frozenset[str] = frozenset()  # from /v1/models, on top of the base pod's


class PodStore:
    """Merges discovery and scraped metrics into the published pod snapshot."""

    def __init__(
        self,
        on_change: Callable[[tuple[Pod, ...]], Any],
        *,
        stale_after_s: float | None = 2.0,
        grace_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if stale_after_s is not None and stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0 or None, got {stale_after_s}")
        self.stale_after_s = stale_after_s
        self.grace_s: float = (stale_after_s or 0.0) if grace_s is None else grace_s
        self._on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._health: dict[PodId, _Health] = {}
        # id -> (base, its adapters read, merged)
        self._built_from: dict[PodId, tuple[Pod, frozenset[str], Pod]] = {}
        self.base_pods: tuple[Pod, ...] = ()  # as discovery gave them
        self.pods: tuple[Pod, ...] = ()  # the last published snapshot

    def scrape_ages(self) -> dict[PodId, float | None]:
        """Seconds since each known pod's last successful scrape (None: none yet)."""
        now = self._clock()
        with self._lock:
            last = {pod: h.last_ok_s for pod, h in self._health.items()}
        return {pod: None if t is None else round(now - t, 3) for pod, t in last.items()}

    def set_pods(self, pods: Sequence[Pod]) -> None:
        """Discovery's pods, replacing the previous set (order is kept)."""
        with self._lock:
            now = self._clock()
            self.base_pods = tuple(pods)
            health = {p.id: self._health.get(p.id) or _Health(now) for p in self.base_pods}
            self._health = health
            self._publish(now)

    def update_metrics(
        self, updates: Iterable[MetricsUpdate], adapters: Iterable[AdaptersUpdate] = ()
    ) -> None:
        """Scrape outcomes, published together; an empty batch re-checks staleness.

        Updates for pods discovery no longer lists are ignored.
        """
        with self._lock:
            for found in adapters:
                health = self._health.get(found.pod_id)
                if health is not None and found.adapters != health.adapters:
                    health.adapters = found.adapters
            now = self._clock()
            for update in updates:
                health = self._health.get(update.pod_id)
                if health is None:
                    continue
                if update.metrics is not None:
                    health.last_ok_s = now
                    health.reachable = True
                    if update.metrics != health.metrics:
                        health.metrics = update.metrics
                elif not update.reachable:
                    health.reachable = False
            self._publish(now)

    def _is_fresh(self, health: _Health, now: float) -> bool:
        if self.stale_after_s is None:
            return True
        if not health.reachable:
            return False
        if health.last_ok_s is None:
            return now - health.first_seen_s <= self.grace_s
        return now - health.last_ok_s <= self.stale_after_s

    def _publish(self, now: float) -> None:
        built_from: dict[PodId, tuple[Pod, frozenset[str], Pod]] = {}
        merged: list[Pod] = []
        for base in self.base_pods:
            health = self._health[base.id]
            ready = base.ready and self._is_fresh(health, now)
            prev = self._built_from.get(base.id)
            if (
                prev is not None
                and prev[2].ready == ready
                and prev[2].metrics is health.metrics
                and prev[1] is health.adapters
                and (prev[0] is base or prev[0] == base)
            ):
                pod = prev[2]
            else:
                pod = _merge(base, ready, health)
            built_from[base.id] = (base, health.adapters, pod)
            merged.append(pod)
        self._built_from = built_from
        if len(merged) == len(self.pods) and all(map(operator.is_, merged, self.pods)):
            return
        self.pods = tuple(merged)
        self._on_change(self.pods)


def _merge(base: Pod, ready: bool, health: _Health) -> Pod:
    """The published pod: the base pod, its readiness, metrics and adapters read."""
    if not health.adapters:
        return replace(base, ready=ready, metrics=health.metrics)
    return replace(
        base,
        ready=ready,
        metrics=health.metrics,
        models=base.models | health.adapters,
        adapters=base.adapters | health.adapters,
    )
