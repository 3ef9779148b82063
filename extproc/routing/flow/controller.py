"""Flow control: admit, hold, dispatch or refuse each request while pods are saturated.

``admit`` runs on the request's thread. While the request's model is not saturated and
none of its requests of the same or a higher priority is held, it returns None: the
request is routed at once, as without flow control (one saturation check, usually one
pod). Otherwise a sheddable request (priority below 0) is refused at once while others
are held (they go first) or the pods are full (the reserve aside: where only the reserve
stands in its way it is held like the rest), and any other is held: ``admit`` returns its
``Held`` and the request waits in its model's ``ModelQueue``. A full queue refuses the
arriving request, unless it outranks the lowest band, whose newest request is then
refused in its place.

One thread (``extproc-flow``) dispatches: woken when a request ends, when a new pod
snapshot arrives (a scrape, a pod joining) or at the earliest time to live, it routes
held requests, best band first, among the pods with room, while their model has room (each routing moves the
in-flight counts the saturation check reads, so a freed slot takes one request), and
refuses those whose time to live ended (429 ``queue_timeout``). On ``close`` (the
drain) every held request is dispatched at once: none is lost.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from prometheus_client import CollectorRegistry

from extproc.errors import ExtProcError, Overloaded
from extproc.pods import Pod
from extproc.routing.decision import RouteDecision
from extproc.routing.flow.classify import Classifier, FlowClass, Objectives
from extproc.routing.flow.config import FlowConfig
from extproc.routing.flow.held import Held
from extproc.routing.flow.metrics import FlowMetrics
from extproc.routing.flow.queue import Entry, ModelQueue
from extproc.routing.flow.saturation import SaturationDetector
from extproc.scheduling.inflight import InFlight

log = logging.getLogger("extproc.flow")

IDLE_WAKE_S = 0.5  # the dispatcher looks at the queue at least this often
HOT_S = 1.0  # after a model was saturated, this long its requests go to pods with room
Route = Callable[[], RouteDecision | Future[RouteDecision]]


class FlowController:
    """Holds requests while their model's pods are saturated (``FlowConfig``)."""

    def __init__(
        self,
        config: FlowConfig,
        in_flight: InFlight,
        registry: CollectorRegistry,
        *,
        count_error: Callable[[ExtProcError], None] = lambda _: None,
    ) -> None:
        self.config = config
        self.metrics = FlowMetrics(registry)
        self.objectives = Objectives(config.objectives)
        self.classifier = Classifier(
            config,
            self.objectives,
            lambda reason: self.metrics.default_objective.labels(reason).inc(),
        )
        self.saturation = SaturationDetector(config, in_flight)
        self.metrics.frozen_pods.set_function(self.saturation.frozen_over)
        self._count_error = count_error
        self._lock = threading.Lock()
        self._queues: dict[str, ModelQueue] = {}
        self._deadlines: list[tuple[float, int, Entry]] = []
        self._count = 0
        self._bytes = 0
        self._wake = threading.Event()
        self._closed = False
        self._was_saturated: dict[str, bool] = {}
        self._hot_until: dict[str, float] = {}  # model -> when its last saturation is old
        self._straight: dict[int, Any] = {}  # priority -> its not_saturated counter
        self._thread = threading.Thread(target=self._run, name="extproc-flow", daemon=True)
        self._thread.start()

    @property
    def held(self) -> int:
        """Requests held now, every model."""
        return self._count

    def classify(
        self, headers: Mapping[str, str] | None, data: Mapping[str, Any] | None
    ) -> FlowClass:
        return self.classifier.classify(headers, data)

    def admit(self, model: str, flow: FlowClass, size: int, cost: int, route: Route) -> Held | None:
        """None: route now. A ``Held``: the request waits; ``route`` is called when it
        is dispatched and its result becomes the Held's.

        Raises:
            Overloaded: refused at once (sheddable while saturated, or the queue full).
        """
        with self._lock:
            queue = self._queues.get(model)
            best = queue.best_priority() if queue is not None else None
            first = best is None or flow.priority > best  # it would be dispatched first
            if self._closed or (first and not self._saturated(model, flow.priority)):
                self._straight_through(flow.priority).inc()
                return None
            refusal: Overloaded | None
            if flow.priority < 0 and (not first or self._full(model, flow.priority)):
                # requests wait, or the pods are full: no room for it
                refusal = self._refusal(flow.priority, "shed", "the pods are saturated")
            else:
                refusal = self._make_room(flow.priority, size)
            if refusal is None:
                return self._hold(model, flow, size, cost, route)
        self._count_error(refusal)
        raise refusal

    def candidates(self, model: str, pods: Sequence[Pod]) -> Sequence[Pod]:
        """Where a request admitted at once may go: while its model was saturated lately
        (``HOT_S``), the pods with room only (a high band's request must take the room
        left, not queue behind a full pod the scorers liked); else every pod, at no cost."""
        if self._hot(model):
            return self.with_room(pods)
        return pods

    def with_room(self, pods: Sequence[Pod]) -> Sequence[Pod]:
        """The pods with a free batch slot, else those not over their limits (all of
        them if none is): where a request dispatched from the queue may go, so that it
        takes the slot that freed rather than a place behind a full batch or another
        pod's queue."""
        free = [pod for pod in pods if self.saturation.free_slots(pod) > 0]
        if free:
            return free
        room = [pod for pod in pods if not self.saturation.over(pod)]
        return room or pods

    def _straight_through(self, priority: int) -> Any:
        """The dispatched{reason=not_saturated} counter of ``priority`` (looked up once:
        it counts every request)."""
        counter = self._straight.get(priority)
        if counter is None:
            counter = self._straight[priority] = self.metrics.dispatched.labels(
                str(priority), "not_saturated"
            )
        return counter

    def pods_changed(self, pods: tuple[Pod, ...]) -> None:
        """A new pod snapshot (scrape, pods joining or leaving): room may have freed."""
        self.saturation.pods_changed(pods)
        self.wake()

    def wake(self) -> None:
        """Capacity may have freed (a request ended): let the dispatcher look."""
        if self._count:
            self._wake.set()

    def close(self, timeout_s: float = 5.0) -> int:
        """The drain: stop holding, dispatch every held request now; how many were."""
        with self._lock:
            self._closed = True
        self._wake.set()
        self._thread.join(timeout_s)
        dispatched = 0
        while True:
            with self._lock:
                entry = self._pop_any()
            if entry is None:
                return dispatched
            dispatched += self._dispatch(entry, "drain")

    # -- holding (under the lock) --------------------------------------------------------

    def _full(self, model: str, priority: int) -> bool:
        """Saturated even without the reserve: a sheddable request is refused only then
        (or while others wait). Where only the reserve stands in its way, a burst of a
        pool far from full, it is held like any other: shedding is for overload."""
        return self.saturation.saturated(model, priority, reserve=False)

    def _hot(self, model: str) -> bool:
        """The model was saturated within ``HOT_S``: its requests go to the pods with room."""
        return self._hot_until.get(model, 0.0) > time.monotonic()

    def _saturated(self, model: str, priority: int) -> bool:
        saturated = self.saturation.saturated(model, priority)
        if saturated:
            self._hot_until[model] = time.monotonic() + HOT_S
        if self._was_saturated.get(model) is not saturated:  # the gauge moves on changes only
            self._was_saturated[model] = saturated
            self.metrics.saturated.labels(model).set(1 if saturated else 0)
        return saturated

    def _make_room(self, priority: int, size: int) -> Overloaded | None:
        """None if a request of ``priority`` and ``size`` bytes fits (evicting the
        newest of a lower band if it must), else its refusal."""
        config = self.config
        while self._count >= config.max_requests or self._bytes + size > config.max_bytes:
            victim = self._lowest()
            if victim is None or victim.priority >= priority:
                return self._refusal(priority, "queue_full", "the queue is full")
            self._remove(victim)
            self._refuse(victim, "evicted", "a request of a higher priority took its place")
        return None

    def _hold(self, model: str, flow: FlowClass, size: int, cost: int, route: Route) -> Held:
        now = time.monotonic()
        held = Held(now + self.config.ttl_for(flow.priority), flow.priority)
        entry = Entry(held, model, flow.priority, flow.fairness_key, cost, size, now, route)
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = ModelQueue()
        queue.push(entry)
        heapq.heappush(self._deadlines, (held.deadline, entry.seq, entry))
        self._count += 1
        self._bytes += size
        self._gauges(entry, 1)
        held.add_done_callback(lambda done: self._on_done(entry, done))
        self._wake.set()
        return held

    def _remove(self, entry: Entry) -> None:
        """``entry`` leaves its queue otherwise than by ``pop`` (refused, cancelled)."""
        self._queues[entry.model].discard(entry)
        self._taken(entry)

    def _gauges(self, entry: Entry, sign: int) -> None:
        labels = (entry.model, str(entry.priority))
        self.metrics.queue_requests.labels(*labels).inc(sign)
        self.metrics.queue_bytes.labels(*labels).inc(sign * entry.size)

    def _lowest(self) -> Entry | None:
        candidates = [e for q in self._queues.values() if (e := q.lowest()) is not None]
        return min(candidates, key=lambda e: (e.priority, -e.seq)) if candidates else None

    def _pop_any(self) -> Entry | None:
        for queue in self._queues.values():
            entry = queue.pop()
            if entry is not None:
                self._taken(entry)
                return entry
        return None

    def _taken(self, entry: Entry) -> None:
        """``entry`` left its queue by ``pop``: the totals follow."""
        self._count -= 1
        self._bytes -= entry.size
        self._gauges(entry, -1)

    def _on_done(self, entry: Entry, held: Future[RouteDecision]) -> None:
        """The Held is done: if cancelled (the client left) while queued, it leaves."""
        if not held.cancelled():
            return
        with self._lock:
            if not entry.queued:
                return
            self._remove(entry)
        priority = str(entry.priority)
        self.metrics.cancelled.labels(priority).inc()
        self.metrics.queued.labels(priority, "cancelled").observe(time.monotonic() - entry.enqueued)

    # -- refusing ------------------------------------------------------------------------

    def _refusal(self, priority: int, code: str, why: str) -> Overloaded:
        self.metrics.refused.labels(str(priority), code).inc()
        return Overloaded(
            f"extproc refused the request: {why} (flow control, priority {priority}); "
            f"retry after {self.config.retry_after_s} s",
            code=code,
            retry_after_s=self.config.retry_after_s,
        )

    def _refuse(self, entry: Entry, code: str, why: str) -> None:
        """A held request is refused (already out of its queue)."""
        error = self._refusal(entry.priority, code, why)
        self.metrics.queued.labels(str(entry.priority), "refused").observe(
            time.monotonic() - entry.enqueued
        )
        self._count_error(error)
        if entry.held.set_running_or_notify_cancel():
            entry.held.set_exception(error)

    # -- dispatching (the flow thread) ---------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self._sleep_s())
            self._wake.clear()
            if self._closed:
                return
            try:
                self._expire()
                self._dispatch_ready()
            except Exception:  # a bug must not stop dispatching for good
                log.exception("unexpected error in flow control's dispatcher")

    def _sleep_s(self) -> float:
        with self._lock:
            while self._deadlines and not self._deadlines[0][2].queued:
                heapq.heappop(self._deadlines)
            if not self._deadlines:
                return IDLE_WAKE_S
            return min(IDLE_WAKE_S, max(0.0, self._deadlines[0][0] - time.monotonic()))

    def _expire(self) -> None:
        now = time.monotonic()
        expired: list[Entry] = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, _, entry = heapq.heappop(self._deadlines)
                if entry.queued:
                    self._remove(entry)
                    expired.append(entry)
        for entry in expired:
            self._refuse(entry, "queue_timeout", "its time to live ended in the queue")

    def _dispatch_ready(self) -> None:
        """Route held requests while their model has room, best band first."""
        for model in list(self._queues):
            while True:
                with self._lock:
                    queue = self._queues[model]
                    best = queue.best_priority()
                    # Lower bands see the pods as full no later than the best one does.
                    if best is None or self._saturated(model, best):
                        break
                    entry = queue.pop()
                    if entry is None:
                        break
                    self._taken(entry)
                self._dispatch(entry, "capacity")

    def _dispatch(self, entry: Entry, reason: str) -> int:
        """Route ``entry`` and hand its outcome to its Held; 1 if it was routed."""
        held = entry.held
        if not held.set_running_or_notify_cancel():
            return 0  # the client left (``_on_done`` counted it)
        priority = str(entry.priority)
        self.metrics.dispatched.labels(priority, reason).inc()
        self.metrics.queued.labels(priority, "dispatched").observe(
            time.monotonic() - entry.enqueued
        )
        try:
            routed = entry.route()
        except BaseException as exc:  # noqa: BLE001 - the Held carries it to the wire
            held.set_exception(exc)
            return 1
        if isinstance(routed, Future):
            # Waited for (tokenizing, on the preparing threads): the next dispatch must
            # see this one in flight.
            error = routed.exception()
            if error is not None:
                held.set_exception(error)
                return 1
            routed = routed.result()
        held.set_result(routed)
        return 1
