"""Whether a model's pods are all saturated: flow control's cue to hold requests.

A pod is over its limits when its estimated waiting requests reach ``maxWaiting`` or
its KV cache use reaches ``maxKvUsage``. The estimate counts the requests in the pod
now, less its batch slots (the most requests any scrape showed it running). The
requests in the pod are extproc's in-flight count for it (exact and immediate for what
extproc routed; with ``--redis-url`` the other replicas' picks are in flight here too),
or, if more, the last scrape's running and waiting moved by that count since the scrape
(traffic extproc did not route). A scrape alone would lag: requests routed between the
pod's answer and its publication, or ended before the access log said so, would be
missed or counted twice, and a pool held at its slots would be fed past them.

A pod's slots (its batch size) are known:

* from the start when the operator gives them (``batchSlots``, the engines'
  ``--max-num-seqs``);
* else once a scrape shows two or more requests waiting, or two scrapes in a row one: it
  is full. A single waiting request proves nothing, as a request also waits a moment for
  the engine's next step with slots free, which a scrape may catch at any load: a pool
  taken for full at the few requests it ran then would be held (and with a reserve its
  low bands refused) at half its size. A burst from idle queues several at once.

Either way the slots grow to the most a scrape showed running; while a scrape shows the
pod running its most and queueing nothing, one more request is let in now and then (at
every scrape while that grows its slots): a probe that lets slots learned low grow. Until
its size is known a pod is over only by its KV use: the most it ran so far may be far
below its batch size (a fresh extproc, a quiet pod), and feeding it only one request
beyond that would ramp it up one request a scrape; its engine queues the excess, as
without flow control. Without scraping (``--stale-after-s 0``, ``FlowConfig.scraped``
False) no slot is ever known: the estimate is extproc's in-flight count alone, and
``maxWaiting`` (at least 1) caps it.

A pod whose next scrape repeats the last one exactly is not republished, so its
baseline stays older: the estimate can then run high by requests routed and ended since.

A reading can also freeze: vLLM updates its gauges at each engine step, so when every
request a pod ran is aborted (a client storm of cancels) it keeps showing them running
and their KV cache in use until its next step (vllm-project/vllm#22545), and a pod held
over its limits by that reading would never get the request that makes it step. So a pod
over its limits with nothing of extproc's in flight there (other replicas' picks
included) and the same reading for ``FROZEN_S`` is *frozen*: it takes one request at a
time, which wakes it, until a new reading tells its real state
(``extproc_flow_frozen_pods``). A pod at its limits serving traffic changes its reading
at every step, so it is never taken for frozen.

A model is saturated when every ready pod serving it is over; a model no ready pod
serves is not (routing answers 404 or 503 as without flow control). With
``reservedSlots``, it is saturated for priorities below ``reservedFor`` while its pods'
free batch slots, summed, are that many or fewer: the last few slots go to the high band,
which then starts at the engine's next step instead of waiting for one to free (a pod
whose size is not known yet has slots without end). Queue places do not count there: a
high-band request sent to one waits behind a full batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from extproc.pods import Pod, PodId, PodMetrics
from extproc.routing.flow.config import FlowConfig
from extproc.scheduling.inflight import InFlight

PROBE_EVERY_S = 5.0  # a pod at its known size is probed for more slots this often
QUEUED_AT_ONCE = 2  # requests waiting in one scrape that tell a pod's size at once
FROZEN_S = 2.0  # a reading unchanged this long, nothing in flight: frozen (module doc)


class SaturationDetector:
    """Per-pod limits over the scraped metrics and extproc's in-flight counts."""

    def __init__(
        self,
        config: FlowConfig,
        in_flight: InFlight,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._max_waiting = config.max_waiting
        self._max_kv_usage = config.max_kv_usage
        self._scraped = config.scraped
        self._reserved_slots = config.reserved_slots
        self._reserved_for = config.reserved_for
        self._batch_slots = config.batch_slots
        self._in_flight = in_flight
        # pod -> (the metrics it was last published with, its in-flight count then, when
        # they were first published); rebound whole, read lock-free.
        self._baselines: dict[PodId, tuple[PodMetrics, int, float]] = {}
        self._slots: dict[PodId, int] = {}  # the most requests a scrape showed it running
        self._full: set[PodId] = set()  # pods two scrapes in a row showed queueing
        self._queued: set[PodId] = set()  # pods whose last scrape showed requests waiting
        self._probing: set[PodId] = set()  # pods taking one request beyond their slots now
        self._probed: dict[PodId, float] = {}  # when each pod's last probe began
        self._pods: tuple[Pod, ...] = ()
        self._by_id: dict[PodId, Pod] = {}
        self._last_free: dict[str, PodId] = {}  # model -> a pod last found with room

    def pods_changed(self, pods: Sequence[Pod]) -> None:
        """A new pod snapshot: a pod with new metrics (a scrape) takes a new baseline."""
        old = self._baselines
        now = self._clock()
        baselines: dict[PodId, tuple[PodMetrics, int, float]] = {}
        for pod in pods:
            seen = old.get(pod.id)
            if seen is not None and seen[0] is pod.metrics:
                baselines[pod.id] = seen
                continue
            baselines[pod.id] = (pod.metrics, self._in_flight.get(pod.id), now)
            metrics = pod.metrics
            if self._batch_slots is not None and pod.id not in self._slots:
                self._slots[pod.id] = self._batch_slots  # told: known before it is full
                self._full.add(pod.id)
            grew = metrics.running > self._slots.get(pod.id, 0)
            if grew:
                self._slots[pod.id] = metrics.running
            self._probe(pod.id, metrics, grew, now)
            if metrics.waiting > 0:
                if metrics.waiting >= QUEUED_AT_ONCE or pod.id in self._queued:
                    self._full.add(pod.id)
                self._queued.add(pod.id)
            else:
                self._queued.discard(pod.id)
        self._baselines = baselines
        for gone in self._slots.keys() - baselines.keys():  # a pod back later may differ
            del self._slots[gone]
            self._full.discard(gone)
            self._queued.discard(gone)
            self._probed.pop(gone, None)
            self._probing.discard(gone)
        self._by_id = {pod.id: pod for pod in pods}
        self._pods = tuple(pods)

    def estimated_waiting(self, pod: Pod) -> int:
        """Requests in the pod now beyond its known batch slots (negative: slots free)."""
        in_flight = self._in_flight.get(pod.id)
        baseline = self._baselines.get(pod.id)
        since = in_flight - (baseline[1] if baseline is not None else 0)
        scraped = pod.metrics.running + pod.metrics.waiting + since
        return max(in_flight, scraped) - self._slots.get(pod.id, 0)

    def over(self, pod: Pod) -> bool:
        """The pod is at or over one of its limits (and not frozen: module doc)."""
        return self._over(pod) and not self.frozen(pod)

    def frozen(self, pod: Pod) -> bool:
        """Nothing in flight to the pod and the same reading for ``FROZEN_S``."""
        if self._in_flight.get(pod.id) > 0:
            return False
        baseline = self._baselines.get(pod.id)
        return baseline is not None and self._clock() - baseline[2] >= FROZEN_S

    def frozen_over(self) -> int:
        """Pods over their limits by a frozen reading now (the gauge)."""
        return sum(1 for pod in self._pods if self._over(pod) and self.frozen(pod))

    def _over(self, pod: Pod) -> bool:
        if pod.metrics.kv_usage >= self._max_kv_usage:
            return True
        if not self._scraped:
            return self._in_flight.get(pod.id) >= max(1.0, self._max_waiting)
        return pod.id in self._full and self.estimated_waiting(pod) >= self._limit(pod)

    def _probe(self, pod_id: PodId, metrics: PodMetrics, grew: bool, now: float) -> None:
        """Until the next scrape, let one request beyond the pod's slots in (a probe) if
        this scrape shows it running its most and queueing nothing, and its slots just
        grew or it was not probed for ``PROBE_EVERY_S``: slots learned low (a request
        waits a moment for the engine's next step even with slots free) grow to the
        pod's size, while a pod at its size takes an extra request only now and then."""
        quiet = metrics.waiting == 0 and metrics.running >= self._slots.get(pod_id, 0)
        if quiet and (grew or now - self._probed.get(pod_id, -PROBE_EVERY_S) >= PROBE_EVERY_S):
            self._probed[pod_id] = now
            self._probing.add(pod_id)
        else:
            self._probing.discard(pod_id)

    def _limit(self, pod: Pod) -> float:
        """``maxWaiting``, one more while the pod is probed."""
        return self._max_waiting + (1 if pod.id in self._probing else 0)

    def room(self, pod: Pod) -> float:
        """Requests the pod takes before it is over its limits (0 if it is over; 1 if
        frozen)."""
        if self._over(pod):
            return 1.0 if self.frozen(pod) else 0.0
        if not self._scraped:
            return max(1.0, self._max_waiting) - self._in_flight.get(pod.id)
        if pod.id not in self._full:
            return float("inf")
        return self._limit(pod) - self.estimated_waiting(pod)

    def free_slots(self, pod: Pod) -> float:
        """Batch slots free in the pod now: a request sent there starts at the engine's
        next step instead of waiting in its queue (unbounded while its size is unknown;
        without scraping, its room; 1 if frozen)."""
        if self._over(pod):
            return 1.0 if self.frozen(pod) else 0.0
        if not self._scraped:
            return self.room(pod)
        if pod.id not in self._full:
            return float("inf")
        return max(0.0, -self.estimated_waiting(pod))

    def _spare(self, pod: Pod, reserved: bool) -> float:
        """What a pod adds towards the model's room: its free slots where a reserve is
        kept (a queue place, ``maxWaiting``'s or a probe's, is no place for the high
        band: it waits there behind a full batch), else its room."""
        return self.free_slots(pod) if reserved else self.room(pod)

    def saturated(self, model: str, priority: int, *, reserve: bool = True) -> bool:
        """Every ready pod serving ``model`` (in the last snapshot) is over its limits,
        or, with ``reserve`` and below ``reservedFor``, their free slots are no more than
        ``reservedSlots``; False if no ready pod serves it.

        The pod last found with room is tried first: while the model is not saturated a
        check usually costs one pod, not the whole pool.
        """
        reserved = reserve and self._reserved_slots > 0 and priority < self._reserved_for
        needed = self._reserved_slots if reserved else 0
        last_id = self._last_free.get(model)
        last = self._by_id.get(last_id) if last_id is not None else None
        if last is not None and last.ready and self._spare(last, reserved) > needed:
            return False
        candidates = 0
        room = 0.0
        for pod in self._pods:
            if pod.ready and pod.serves(model):
                candidates += 1
                pod_room = self._spare(pod, reserved)
                room += pod_room
                if pod_room > 0:
                    self._last_free[model] = pod.id
                if room > needed:
                    return False
        return candidates > 0
