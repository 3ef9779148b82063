"""Routing decisions and their completion, without any gRPC: the server's only partner.

``Router.route`` turns one request (path, body, request id, session header, subset hint)
into the ordered destination list (``route_or_defer``: as a Future when the request needs
slow preparation first, tokenizing, which runs on the router's ``preparing`` threads);
``Router.complete`` is told how the request ended (from Envoy's access log) and lets the
scheduler record the prompt for the pod that really served it, only when the response
ended successfully.

Routed requests wait for their completion in ``PendingRecords``, bounded in size and
age, so requests whose completion never arrives (extproc restarted, log lost) cannot
grow memory. From routing to its end a request counts in flight (``InFlight``) on the
pod it was routed to (and on its prefill pod, with prefill/decode disaggregation), and
its prompt counts as arriving there (``Scheduler.arriving``, provisional credit for the
next requests' scoring); a retry that lands elsewhere is still counted on the pick. At
the end, however it ends, both go; only a success is recorded, for the pod that served.

Several replicas (``routing.records``): with ``carry_records`` each decision carries its
``Record``, which the wire layer puts in the reply's metadata and Envoy's access log
brings back, so a replica that did not route a request still records it from there
(outcome ``recorded_from_metadata``). Given ``share`` (``routing.sharing``'s publish),
every pick and every end is published: ``apply_started`` takes the other replicas'
picks (counted in flight and credited as arriving here too, as a pending request of
theirs), and ``apply_shared`` their ends: their records enter this view, and a request
ends here, however it was routed. A pick heard after its end (ids of recent ends are
kept) is dropped, and one whose end never comes expires with the pending table.

A body naming no model (absent, null or ``""``) is routed, as vLLM serves it, as the one
base model the ready candidate pods serve (its body unchanged: the pod fills the model
in); when they serve several it is refused naming them. Flow control and the rewrite
rules see that model.

Model rewrites (``routing.rewrites``): a request whose model a rule matches is parsed,
scheduled, counted and recorded as a request for the target chosen (by its session key,
else at random), and its decision carries the body naming the target, which the wire
layer sends on instead of the client's; a target no pod serves is answered 404 naming
the rule.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, NamedTuple

from prometheus_client import REGISTRY, CollectorRegistry

from extproc.errors import BadRequest, ExtProcError, ModelNotFound, NoReadyPods
from extproc.pods import Pod, PodId
from extproc.request.parse import DEFAULT_MAX_BODY_BYTES, InferenceRequest, parse_request
from extproc.request.render import Rendering
from extproc.routing.decision import RouteDecision
from extproc.routing.flow.config import FlowConfig
from extproc.routing.flow.controller import FlowController
from extproc.routing.metrics import RouterMetrics
from extproc.routing.observe import (
    Ended,
    EndTiming,
    Routed,
    RouteObserver,
    tell_ended,
    tell_routed,
)
from extproc.routing.pending import (
    DEFAULT_MAX_PENDING,
    DEFAULT_PENDING_TTL_S,
    Pending,
    PendingRecords,
)
from extproc.routing.preparing import PreparePool
from extproc.routing.records import Carried, Record, Shared, Started
from extproc.routing.rewrites import RewriteRule, merged, rewritten_body
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import Cycle
from extproc.scheduling.scheduler import Scheduler

log = logging.getLogger("extproc.routing")

RECENT_ENDS = 10_000  # ids of the latest ends, so a pick heard after its end is dropped


class Rewritten(NamedTuple):
    """A request whose model a rewrite rule changed: what it asked, by which rule, and
    the body to send instead."""

    model: str
    rule: RewriteRule
    body: bytes


class Router:
    """Routes requests with a scheduler over the current pod snapshot."""

    def __init__(
        self,
        scheduler: Scheduler,
        pods: Sequence[Pod] = (),
        *,
        num_fallbacks: int = 2,
        session_header: str | None = "x-session-id",
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        rendering: Rendering = Rendering.EXTENDED,
        max_pending: int = DEFAULT_MAX_PENDING,
        pending_ttl_s: float = DEFAULT_PENDING_TTL_S,
        in_flight: InFlight | None = None,
        registry: CollectorRegistry = REGISTRY,
        carry_records: bool = False,
        replica_id: str | None = None,
        preparing: PreparePool | None = None,
        share: Callable[[Shared | Started], object] | None = None,
        flow: FlowConfig | None = None,
        rewrites: Sequence[RewriteRule] = (),
    ) -> None:
        """``max_pending`` and ``pending_ttl_s`` bound the routed requests awaiting their
        end (``PendingRecords``); ``share``, when replicas share their view, is told of
        every pick and end (``RedisSharing.publish``); ``flow``: flow control's settings
        (``routing.flow``; None or disabled: no request is held); ``rewrites``: the
        configuration's model rewrite rules (``routing.rewrites``)."""
        if num_fallbacks < 0:
            raise ValueError(f"num_fallbacks must be >= 0, got {num_fallbacks}")
        self.scheduler = scheduler
        self.num_fallbacks = num_fallbacks
        self.session_header = session_header
        self.max_body_bytes = max_body_bytes
        self.rendering = rendering
        self.in_flight = in_flight if in_flight is not None else InFlight()
        self.pending = PendingRecords(self._end, max_pending, pending_ttl_s)
        self.metrics = RouterMetrics(registry)
        self.metrics.pending.set_function(lambda: len(self.pending))
        self.preparing = preparing if preparing is not None else PreparePool()
        self.metrics.preparing.set_function(lambda: self.preparing.num_in)
        self.carry_records = carry_records
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.geometries = scheduler.block_geometries
        self.share = share
        self._ended: OrderedDict[str, None] = OrderedDict()  # with ``share``: RECENT_ENDS
        self._ended_lock = threading.Lock()  # an id's end and its pick heard at once
        self.flow = (
            FlowController(flow, self.in_flight, registry, count_error=self._count_error)
            if flow is not None and flow.enabled
            else None
        )
        self.observers: list[RouteObserver] = []  # told of each decision and end
        self._file_rewrites = tuple(rewrites)
        self._watched_rewrites: tuple[RewriteRule, ...] = ()
        self.rewrites = merged(self._file_rewrites, ())  # rebound whole: read lock-free
        self.pods: tuple[Pod, ...] = ()
        self._pod_ids: frozenset[PodId] = frozenset()
        self.set_pods(pods)

    def set_scheduler(self, scheduler: Scheduler) -> None:
        """Route with ``scheduler`` from the next request on (a configuration reload):
        the requests in flight end and are recorded through it, as pending records hold
        their cycles, not their scheduler."""
        scheduler.pods_changed(self.pods)
        self.geometries = scheduler.block_geometries
        self.scheduler = scheduler

    def set_rewrites(self, rules: Sequence[RewriteRule]) -> None:
        """The configuration's rewrite rules, from the next request on (a reload)."""
        self._file_rewrites = tuple(rules)
        self.rewrites = merged(self._file_rewrites, self._watched_rewrites)

    def set_watched_rewrites(self, rules: Sequence[RewriteRule]) -> None:
        """The watched ``InferenceModelRewrite`` objects' rules, oldest object first (the
        file's rule for a model wins over theirs)."""
        self._watched_rewrites = tuple(rules)
        self.rewrites = merged(self._file_rewrites, self._watched_rewrites)

    def set_pods(self, pods: Sequence[Pod]) -> None:
        """Publish a new pod snapshot (rebinding: the request path reads it lock-free)."""
        self.pods = tuple(pods)
        self._pod_ids = frozenset(p.id for p in self.pods)
        self.metrics.pods_known.set(len(self.pods))
        self.metrics.pods_ready.set(sum(p.ready for p in self.pods))
        self.scheduler.pods_changed(self.pods)
        if self.flow is not None:
            self.flow.pods_changed(self.pods)

    def route(
        self,
        path: str,
        body: bytes,
        *,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        subset: Sequence[str] | None = None,
    ) -> RouteDecision:
        """Pick the pods for one request, best first, all on the calling thread.

        Args:
            path: the request path (selects the API).
            body: the request body.
            request_id: Envoy's x-request-id; with it the completion can be recorded.
            headers: request headers extproc was sent (lower-case names).
            subset: the gateway's subset hint: only these ``ip:port`` may be chosen.

        Raises:
            ExtProcError: the error to answer instead (400, 404, 413, 429, 503).
        """
        started = time.perf_counter()
        cycle, pods, rewritten = self._begin(path, body, headers, subset)
        arrival = _Arrival(started, headers) if self.observers else None
        return self._decide(cycle, pods, request_id, started, arrival, rewritten)

    def route_or_defer(
        self,
        path: str,
        body: bytes,
        *,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        subset: Sequence[str] | None = None,
    ) -> RouteDecision | Future[RouteDecision]:
        """``route``, but a request that needs slow preparation first (``Scheduler.
        prepare``: a prompt to tokenize) is routed on the ``preparing`` threads and comes
        as a Future (raising what ``route`` raises); when they are full it is routed here
        at once without that work (the plugin falls back and counts it).

        With flow control, a request whose model's pods are all saturated is held: the
        Future is a ``Held`` (``routing.flow``), routed when a pod has room (among the
        pods with room: a held request is not sent behind another's queue), or raising
        ``Overloaded`` (429) when refused; a sheddable one raises ``Overloaded`` at once.
        """
        started = time.perf_counter()
        cycle, pods, rewritten = self._begin(path, body, headers, subset)
        arrival = _Arrival(started, headers) if self.observers else None
        if self.flow is not None:
            request = cycle.request
            flow = self.flow

            def dispatched() -> RouteDecision | Future[RouteDecision]:
                now = time.perf_counter()
                if arrival is not None:
                    arrival.queued_s = now - started
                pods = flow.with_room(self._candidates(subset))
                return self._prepare_and_decide(cycle, pods, request_id, now, arrival, rewritten)

            held = flow.admit(
                request.model,
                flow.classify(headers, request.data),
                len(body),
                _estimated_tokens(request.prompt, request.data),
                dispatched,
            )
            if held is not None:
                return held
            pods = flow.candidates(request.model, pods)
        return self._prepare_and_decide(cycle, pods, request_id, started, arrival, rewritten)

    def _prepare_and_decide(
        self,
        cycle: Cycle,
        pods: Sequence[Pod],
        request_id: str | None,
        started: float,
        arrival: _Arrival | None,
        rewritten: Rewritten | None,
    ) -> RouteDecision | Future[RouteDecision]:
        """Prepare the cycle on the preparing threads if it needs it, then decide."""
        work = self.scheduler.prepare(cycle)
        if work is not None:

            def prepared(prepare: bool) -> RouteDecision:
                if prepare:
                    work.run()
                else:
                    work.skip()
                if arrival is not None:
                    arrival.preparing_s = time.perf_counter() - submitted
                return self._decide(cycle, pods, request_id, started, arrival, rewritten)

            submitted = time.perf_counter()
            future = self.preparing.submit(prepared)
            if future is not None:
                return future
            work.skip()
        return self._decide(cycle, pods, request_id, started, arrival, rewritten)

    def _begin(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | None,
        subset: Sequence[str] | None,
    ) -> tuple[Cycle, Sequence[Pod], Rewritten | None]:
        """The request parsed (its model rewritten if a rule matches) into its cycle, the
        pods it may go to, and the rewrite."""
        try:
            request = parse_request(
                path,
                body,
                headers,
                session_header=self.session_header,
                max_body_bytes=self.max_body_bytes,
                rendering=self.rendering,
                default_model=lambda: self.default_model(subset),
            )
            pods = self._candidates(subset)
        except ExtProcError as exc:
            self._count_error(exc)
            raise
        rewritten = None
        if self.rewrites.by_model or self.rewrites.any_model:
            request, rewritten = self._rewrite(request, body)
        return Cycle(request), pods, rewritten

    def _rewrite(
        self, request: InferenceRequest, body: bytes
    ) -> tuple[InferenceRequest, Rewritten | None]:
        """The request for its rule's target (chosen by the session key, if any) and the
        body that says so; unchanged when no rule matches or the target is its model."""
        rule = self.rewrites.rule_for(request.model)
        if rule is None:
            return request, None
        target = rule.choose(request.session_key)
        self.metrics.rewritten(request.model, target)
        if target == request.model or request.data is None:
            return request, None
        data = {**request.data, "model": target}
        rewritten = Rewritten(request.model, rule, rewritten_body(body, request.data, target))
        return replace(request, model=target, data=data), rewritten

    def default_model(self, subset: Sequence[str] | None = None) -> str:
        """The model of a body naming none, as vLLM defaults it: the base model every
        ready candidate serves, when it is one (a LoRA adapter is never the default:
        vLLM serves such a body with its base model, adapters loaded or not).

        Raises:
            NoReadyPods: no candidate is ready.
            ModelNotFound: they serve no base model.
            BadRequest: they serve several base models.
        """
        ready = [p for p in self._candidates(subset) if p.ready]
        if not ready:
            raise NoReadyPods("no pod is ready to serve a request that names no model")
        bases = sorted(frozenset().union(*(p.models - p.adapters for p in ready)))
        if not bases:
            raise ModelNotFound("the request names no model and no ready pod serves a base model")
        if len(bases) > 1:
            raise BadRequest(
                "the request names no model and the pods serve several: name one of: "
                + ", ".join(bases),
                code="missing_model",
                param="model",
            )
        return bases[0]

    def _candidates(self, subset: Sequence[str] | None) -> Sequence[Pod]:
        """The pods a request may go to: all, or those of the gateway's subset hint.

        Raises:
            NoReadyPods: no known pod is in the subset.
        """
        if subset is None:
            return self.pods
        allowed = set(subset)
        pods = [p for p in self.pods if p.address in allowed]
        if not pods:
            raise NoReadyPods(
                "none of the pods in the gateway's subset hint is known: "
                + ", ".join(sorted(allowed)[:5])
            )
        return pods

    def _count_error(self, error: ExtProcError) -> None:
        self.metrics.errors.labels(str(error.http_status), error.code).inc()

    def _decide(
        self,
        cycle: Cycle,
        pods: Sequence[Pod],
        request_id: str | None,
        started: float,
        arrival: _Arrival | None = None,
        rewritten: Rewritten | None = None,
    ) -> RouteDecision:
        """Schedule the cycle and track the request from its pick to its end; the
        observers are told (``arrival``: given when there are observers)."""
        try:
            schedule = self.scheduler.schedule_request(cycle, pods, 1 + self.num_fallbacks)
        except ModelNotFound as exc:
            error = exc if rewritten is None else _target_not_found(rewritten, cycle)
            self._count_error(error)
            raise error from None
        except ExtProcError as exc:
            self._count_error(exc)
            raise
        if schedule.pinned:
            self.metrics.pinned.inc()
        chosen = tuple(schedule.pods[: 1 + self.num_fallbacks])
        prefill = schedule.prefill
        record = None
        pick_tokens = None
        if request_id:  # without an id the end can never be matched: nothing to track
            pick = chosen[0].id
            pick_tokens = cycle.num_prefill_tokens(pick)
            self.in_flight.start(pick, pick_tokens)
            prefill_pod_tokens = 0
            if prefill is not None:  # on flight there too, as Kthena counts its prefill pods
                prefill_pod_tokens = cycle.num_prefill_tokens(prefill.id)
                self.in_flight.start(prefill.id, prefill_pod_tokens)
            self.scheduler.arriving(cycle, pick)
            pending = Pending(
                cycle,
                {p.address: p.id for p in chosen},
                time.monotonic(),
                pick,
                pick_tokens,
                prefill.id if prefill else None,
                prefill_pod_tokens,
            )
            self.pending.add(request_id, pending)
            if self.carry_records:
                record = Record.of(cycle, self.geometries)
            if self.share is not None:
                credited = Record.of(cycle, self.geometries, credit=True)
                self.share(
                    Started(
                        self.replica_id,
                        request_id,
                        credited,
                        pick,
                        pick_tokens,
                        pending.prefill,
                        prefill_pod_tokens,
                    )
                )
        self.metrics.decided(cycle.request.model)
        decided = time.perf_counter()
        self.metrics.scheduling.observe(decided - started)
        if arrival is not None:
            tell_routed(
                self.observers,
                arrival.routed(
                    cycle,
                    request_id,
                    len(pods),
                    chosen,
                    prefill,
                    schedule.pinned,
                    decided,
                    pick_tokens,
                ),
            )
        return RouteDecision(chosen, prefill, record, rewritten.body if rewritten else None)

    def close(self, timeout_s: float) -> bool:
        """The drain: requests held by flow control are routed now; requests still
        waiting for preparation are routed without it, and those being prepared are
        waited for, up to ``timeout_s``; whether all were."""
        if self.flow is not None:
            dispatched = self.flow.close()
            if dispatched:
                log.info("draining: %d requests held by flow control routed", dispatched)
        return self.preparing.close(timeout_s)

    def complete(
        self,
        request_id: str,
        served_address: str | None,
        succeeded: bool,
        attempts: int = 1,
        carried: Callable[[], Carried | None] | None = None,
        timing: EndTiming | None = None,
    ) -> bool:
        """A routed request ended; record it for the pod that served if it succeeded.

        ``carried``: reads the record the request brought back (access-log metadata),
        called only when this replica did not route it (another replica's pick applied
        here just ends: the request is recorded from what it brought, once, and its end
        published). ``timing``: the access log's figures, for the observers. Returns
        whether anything was recorded.
        """
        if not self.observers:
            return self._complete(request_id, served_address, succeeded, attempts, carried)[0]
        recorded, pod, model, pending = self._complete(
            request_id, served_address, succeeded, attempts, carried
        )
        if pod is None and served_address:
            pod = next((p.id for p in self.pods if p.address == served_address), None)
        if pending is None or pod is None:
            ended = Ended(request_id, model, pod, succeeded, attempts, timing)
        else:
            cycle = pending.cycle
            prompt = cycle.num_engine_prompt_tokens
            # The pick's prefill tokens were taken at the pick: no second table lookup.
            uncached = pending.pick_tokens if pod == pending.pick else cycle.num_prefill_tokens(pod)
            predicted = max(0, prompt - uncached)
            exact = cycle.token_ids is not None
            ended = Ended(
                request_id, model, pod, succeeded, attempts, timing, prompt, predicted, exact
            )
        tell_ended(self.observers, ended)
        return recorded

    def _complete(
        self,
        request_id: str,
        served_address: str | None,
        succeeded: bool,
        attempts: int,
        carried: Callable[[], Carried | None] | None,
    ) -> tuple[bool, PodId | None, str | None, Pending | None]:
        """``complete``: whether recorded, the pod that served (if known), the model
        and, for a request routed here, its pending entry."""
        if attempts > 1:
            self.metrics.retries.inc(attempts - 1)
        pending = self._pop(request_id)
        if pending is not None and pending.foreign:  # another replica's pick, heard here
            self._end(pending)
            pending = None
            foreign = True
        else:
            foreign = False
        brought = carried() if pending is None and carried is not None else None
        if pending is None and brought is None:
            self.metrics.outcome["unknown_request"].inc()
            if foreign:  # its router stops counting it in flight
                self._publish(Shared(self.replica_id, request_id))
            return False, None, None, None
        if pending is not None:
            model = pending.cycle.request.model
        else:
            assert brought is not None
            model = brought.record.model
        if pending is not None:
            self._end(pending)
        if not succeeded:
            self.metrics.outcome["failed"].inc()
            self._publish(Shared(self.replica_id, request_id))
            return False, None, model, pending
        pod_by_address: Mapping[str, PodId]
        if pending is not None:
            pod_by_address, prefill = pending.pod_by_address, pending.prefill
        else:
            assert brought is not None
            pod_by_address, prefill = brought.pod_by_address, brought.prefill
        pod = pod_by_address.get(served_address or "")
        if pod is None:
            # Served by the fallback policy after the list ran out: still a known pod?
            pod = next((p.id for p in self.pods if p.address == served_address), None)
        if pod is None:
            self.metrics.outcome["unknown_pod"].inc()
            log.warning(
                "request %s was served by %s, which is no known pod", request_id, served_address
            )
            self._publish(Shared(self.replica_id, request_id))
            return False, None, model, pending
        if pending is not None:
            self.scheduler.record(pending.cycle, pod, prefill)
            self.metrics.outcome["recorded"].inc()
            if self.share is not None:
                record = Record.of(pending.cycle, self.geometries)
                self._publish(Shared(self.replica_id, request_id, record, pod, prefill))
        else:
            assert brought is not None
            self.scheduler.record(brought.record.cycle(), pod, prefill)
            self.metrics.outcome["recorded_from_metadata"].inc()
            self._publish(Shared(self.replica_id, request_id, brought.record, pod, prefill))
        return True, pod, model, pending

    def apply_shared(self, shared: Shared) -> bool:
        """Another replica's end: the request (routed here, or another's pick applied
        here) stops counting in flight, and its record (if any) enters this view, not
        published again. Returns whether recorded."""
        pending = self._pop(shared.request_id)
        if pending is not None:
            self._end(pending)
            if not pending.foreign:
                self.metrics.ended_elsewhere.inc()
        if shared.record is None or shared.pod is None:
            return False
        pods = (shared.pod,) if shared.prefill is None else (shared.pod, shared.prefill)
        if not self._pod_ids.issuperset(pods):
            self.metrics.shared_unknown_pod["end"].inc()
            return False
        self.scheduler.record(shared.record.cycle(), shared.pod, shared.prefill)
        return True

    def apply_started(self, started: Started) -> bool:
        """Another replica's pick: counted in flight and credited as arriving here too
        until its end (``apply_shared``, or ``complete`` if its end is heard here), as a
        pending request of its own. Returns whether applied: not for an unknown pod, nor
        for a request whose end came first."""
        pods = (started.pick,) if started.prefill is None else (started.pick, started.prefill)
        if not self._pod_ids.issuperset(pods):
            self.metrics.shared_unknown_pod["start"].inc()
            return False
        cycle = started.record.cycle()
        cycle.uncached_tokens[started.pick] = started.pick_tokens  # num_prefill_tokens
        if started.prefill is not None:
            cycle.uncached_tokens[started.prefill] = started.prefill_pod_tokens
        pending = Pending(
            cycle,
            {},
            time.monotonic(),
            started.pick,
            started.pick_tokens,
            started.prefill,
            started.prefill_pod_tokens,
            foreign=True,
        )
        with self._ended_lock:
            if started.request_id in self._ended:
                return False
            self.in_flight.start(started.pick, started.pick_tokens)
            if started.prefill is not None:
                self.in_flight.start(started.prefill, started.prefill_pod_tokens)
            self.scheduler.arriving(cycle, started.pick)
            self.pending.add(started.request_id, pending)
        return True

    def _pop(self, request_id: str) -> Pending | None:
        """The request ended: its pending entry, if any; with ``share``, its id is kept
        a while so that its pick, heard late from another replica, is dropped."""
        if self.share is None:
            return self.pending.pop(request_id)
        with self._ended_lock:
            self._ended[request_id] = None
            if len(self._ended) > RECENT_ENDS:
                self._ended.popitem(last=False)
            return self.pending.pop(request_id)

    def _publish(self, shared: Shared) -> None:
        if self.share is not None:
            self.share(shared)

    def abandon(self, request_id: str) -> None:
        """The route was never used (Envoy gave up waiting for it): forget it now rather
        than when it expires, and stop counting it in flight."""
        pending = self._pop(request_id)
        if pending is not None:
            self._end(pending)
            self.metrics.outcome["abandoned"].inc()
            self._publish(Shared(self.replica_id, request_id))

    def _end(self, pending: Pending) -> None:
        """The request ended (completed, abandoned or expired): it leaves the pick's
        in-flight count and its provisional credit goes (``Scheduler.settled``)."""
        self.in_flight.end(pending.pick, pending.pick_tokens)
        if pending.prefill is not None:
            self.in_flight.end(pending.prefill, pending.prefill_pod_tokens)
        self.scheduler.settled(pending.cycle, pending.pick)
        if self.flow is not None:
            self.flow.wake()


class _Arrival:
    """When a request arrived and what it waited for, kept for its ``Routed`` (built
    only when the router has observers)."""

    __slots__ = ("arrived_s", "arrived_unix_ns", "headers", "preparing_s", "queued_s")

    def __init__(self, arrived_s: float, headers: Mapping[str, str] | None) -> None:
        self.arrived_s = arrived_s
        self.arrived_unix_ns = time.time_ns() - int((time.perf_counter() - arrived_s) * 1e9)
        self.headers: Mapping[str, str] = headers or {}
        self.queued_s = 0.0
        self.preparing_s = 0.0

    def routed(
        self,
        cycle: Cycle,
        request_id: str | None,
        num_candidates: int,
        pods: tuple[Pod, ...],
        prefill: Pod | None,
        pinned: bool,
        decided_s: float,
        pick_tokens: int | None,
    ) -> Routed:
        prompt = cycle.num_engine_prompt_tokens
        if pick_tokens is None:
            pick_tokens = cycle.num_prefill_tokens(pods[0].id)
        return Routed(
            request_id,
            cycle.request.model,
            self.headers,
            self.arrived_unix_ns,
            self.arrived_s,
            decided_s,
            self.queued_s,
            self.preparing_s,
            num_candidates,
            pods,
            prefill,
            pinned,
            prompt,
            max(0, prompt - pick_tokens),
            cycle.token_ids is not None,
        )


def _target_not_found(rewritten: Rewritten, cycle: Cycle) -> ModelNotFound:
    return ModelNotFound(
        f"the model {rewritten.model!r} is rewritten to {cycle.request.model!r} "
        f"({rewritten.rule.where}), which no pod serves"
    )


def _estimated_tokens(prompt: str, data: Mapping[str, Any] | None) -> int:
    """A request's tokens for fairness: its prompt's (about 4 characters a token) and
    the output it asks for at most."""
    asked = 0
    if data is not None:
        value = data.get("max_completion_tokens") or data.get("max_tokens") or 0
        asked = value if isinstance(value, int) and not isinstance(value, bool) else 0
    return len(prompt) // 4 + max(0, asked)
