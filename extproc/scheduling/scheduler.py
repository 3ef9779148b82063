"""The scheduler: candidates -> filters -> weighted scores -> pods ordered best first.

total(pod) = sum(weight * score) over the score plugins (each score 0..100); ties go to
the least loaded pod (``max(in flight, waiting + running)``: the router's own count, or
the scrape when it shows more), then randomly, so that equal pods share the load. The
scheduler does no I/O.

Cost: the pods arrive as a snapshot tuple, which the scheduler turns into a ``PodTable``
(NumPy columns) once, when it is published (``pods_changed``). Candidates, filters,
scores and the ranking are then whole-column operations (``TableFilter``,
``TableScorer``; a plugin without them gets ``Pod`` objects as before), so a request's
cost grows little with the number of pods (figures: ``docs/performance.md``).

``schedule_request`` adds what a whole request needs around that pass:

* Prefill/decode disaggregation: when the model has prefill pods and decode pods, the
  decode pods (and ordinary ones) and the prefill pods are filtered and scored in
  separate passes; the request goes to the decode pods best first, and the best prefill
  pod is named in the result (the server sends it on as ``x-prefiller-host-port``).
* PD groups (``pd_group``, Kthena's ``pdGroup``: roles and groups from labels): as
  Kthena, the decode pods are ranked, and each is paired with the best prefill pod of
  its own group (filtered and scored in a pass of their own; a decode pod whose group
  has none left is skipped). Envoy sends one prefill header per request, whatever pod
  a retry reaches, so the result lists the best pair's decode pod and, as fallbacks,
  only the decode pods of the same group (their best prefill is that pod too); decode
  pods of other groups, which would need another prefill pod, are left out.
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache

import numpy as np
from prometheus_client import CollectorRegistry

from extproc.errors import ExtProcError, NoCapacity, NoReadyPods
from extproc.kernels import rank_best, rank_few
from extproc.plain_metrics import PlainHistogram
from extproc.pods import Pod, PodId
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import (
    BlockRecorder,
    Cycle,
    Filter,
    PodsListener,
    Preparation,
    Preparer,
    Provisional,
    Recorder,
    Scorer,
    Scores,
    TableFilter,
    TableScorer,
)
from extproc.scheduling.pdgroup import PDColumns, PDGroup
from extproc.scheduling.podtable import PodTable, Positions
from extproc.scheduling.sessions import Binding, SessionStore

log = logging.getLogger("extproc.scheduling")


FilterStep = Callable[[Cycle, PodTable, Positions], Positions]
ScoreStep = Callable[[Cycle, PodTable, Positions], Scores]


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: int


def table_filter(f: Filter) -> FilterStep:
    """``f`` over a snapshot's rows: its ``filter_table``, or ``filter`` on ``Pod``s."""
    if isinstance(f, TableFilter):
        return f.filter_table

    def by_pods(cycle: Cycle, table: PodTable, candidates: Positions) -> Positions:
        # A plain Filter returns some of the pods it is given, in any order.
        kept = f.filter(cycle, table.take(candidates))
        rows = np.fromiter((table.position[p.id] for p in kept), np.int64, len(kept))
        return np.sort(rows)  # candidates ascend, as score_table may rely on

    return by_pods


def table_scorer(scorer: Scorer) -> ScoreStep:
    """``scorer`` over a snapshot's rows: its ``score_table``, or ``score`` on ``Pod``s."""
    if isinstance(scorer, TableScorer):
        return scorer.score_table

    def by_pods(cycle: Cycle, table: PodTable, candidates: Positions) -> Scores:
        by_id = scorer.score(cycle, table.take(candidates))  # pods left out score 0
        ids = (table.ids[i] for i in candidates.tolist())
        return np.fromiter((by_id.get(i, 0) for i in ids), np.int64, len(candidates))

    return by_pods


SMALL_RANK = 64  # candidates up to which ties are broken by ``rng`` directly (``_order``)
# ``_rank`` ranks only the best ``limit`` when the candidates outnumber them this many times
PARTIAL_RANK_FACTOR = 4

PLUGIN_BUCKETS = (0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.005)


class PluginTimer:
    """``extproc_plugin_duration_seconds{plugin, extension_point}``, children made once."""

    def __init__(self, registry: CollectorRegistry) -> None:
        histogram = PlainHistogram(
            "extproc_plugin_duration_seconds",
            "Time one plugin took for one request, by plugin and extension point (filter, score).",
            PLUGIN_BUCKETS,
            registry,
            ("plugin", "extension_point"),
        )
        self._child = cache(histogram.labels)

    def observe(self, plugin: str, point: str, seconds: float) -> None:
        self._child(plugin, point).observe(seconds)


@dataclass(frozen=True, slots=True)
class Schedule:
    """Where one request goes."""

    pods: list[Pod]  # best first: the pick, then fallbacks (decode pods with PD)
    prefill: Pod | None = None  # the prefill pod, with prefill/decode disaggregation
    pinned: bool = False  # session sticky: sent to the bound pod without scoring


@dataclass(slots=True)
class TracePass:
    """One filter-and-rank pass of ``explain`` (the serving pods, the prefill pods, a PD
    group's prefill pods): its candidates, what each filter kept, each scorer's scores,
    the totals, the load tie-break and the order; pod ids throughout."""

    role: str
    candidates: list[PodId]
    filters: list[tuple[str, list[PodId]]] = field(default_factory=list)  # (name, kept)
    scores: list[tuple[str, int, dict[PodId, int]]] = field(default_factory=list)
    totals: dict[PodId, int] = field(default_factory=dict)
    load: dict[PodId, int] = field(default_factory=dict)
    order: list[PodId] = field(default_factory=list)

    @property
    def ties(self) -> list[list[PodId]]:
        """Groups of pods whose order was drawn at random: equal totals and load."""
        groups: dict[tuple[int, int], list[PodId]] = {}
        for pod in self.order:
            groups.setdefault((self.totals[pod], self.load[pod]), []).append(pod)
        return [g for g in groups.values() if len(g) > 1]


@dataclass(slots=True)
class Trace:
    """``Scheduler.explain``'s record of the passes, filled as ``_filter`` and ``_rank``
    run (None on the request path: nothing is traced there)."""

    passes: list[TracePass] = field(default_factory=list)
    pinned: bool = False
    _table: PodTable | None = None
    _current: TracePass | None = None

    def begin(self, role: str, table: PodTable, candidates: Positions) -> None:
        self._table = table
        self._current = TracePass(role, self._ids(candidates))
        self.passes.append(self._current)

    def resume(self, role: str) -> None:
        """Back to the latest pass of ``role`` (filters ran for several first)."""
        self._current = next(p for p in reversed(self.passes) if p.role == role)

    def _ids(self, rows: Positions) -> list[PodId]:
        assert self._table is not None
        ids = self._table.ids
        return [ids[i] for i in rows.tolist()]

    def filtered(self, name: str, kept: Positions) -> None:
        assert self._current is not None
        self._current.filters.append((name, self._ids(kept)))

    def scored(self, name: str, weight: int, rows: Positions, scores: Scores) -> None:
        assert self._current is not None
        by_pod = dict(zip(self._ids(rows), scores.tolist(), strict=True))
        self._current.scores.append((name, weight, by_pod))

    def ranked(self, rows: Positions, totals: Scores, load: Scores, order: Positions) -> None:
        current = self._current
        assert current is not None
        ids = self._ids(rows)
        current.totals = dict(zip(ids, totals.tolist(), strict=True))
        current.load = dict(zip(ids, load.tolist(), strict=True))
        current.order = self._ids(order)


@dataclass(frozen=True, slots=True)
class Explanation:
    """``Scheduler.explain``'s answer: the schedule (None when it would fail: ``error``)
    and how it came about."""

    schedule: Schedule | None
    trace: Trace
    error: ExtProcError | None


@dataclass(slots=True)
class Scheduler:
    """A configured profile: filters and weighted scorers, plus the plugins that learn."""

    filters: tuple[Filter, ...] = ()
    scorers: tuple[WeightedScorer, ...] = ()
    recorders: tuple[Recorder, ...] = ()
    listeners: tuple[PodsListener, ...] = ()
    provisional: tuple[Provisional, ...] = ()
    preparers: tuple[Preparer, ...] = ()
    in_flight: InFlight | None = None  # the router's counters, for the load tie-break
    rng: random.Random = field(default_factory=random.Random)
    sessions: SessionStore | None = None
    timer: PluginTimer | None = None
    pd_group: PDGroup | None = None
    _table: PodTable | None = field(default=None, init=False, repr=False)
    # Each plugin's table step, resolved once per ``filters``/``scorers`` tuple.
    _filter_steps: tuple[tuple[Filter, ...], tuple[FilterStep, ...]] = field(
        default=((), ()), init=False, repr=False
    )
    _score_steps: tuple[tuple[WeightedScorer, ...], tuple[ScoreStep, ...], list[int]] = field(
        default=((), (), []), init=False, repr=False
    )
    _np_rng: tuple[random.Random, np.random.Generator] | None = field(
        default=None, init=False, repr=False
    )

    def prepare(self, cycle: Cycle) -> Preparation | None:
        """The slow work the plugins have left to do on ``cycle`` before it is scheduled
        (``Preparer``), as one ``Preparation``; None when there is none. Without it run,
        the plugins do their work when they score."""
        work = [p for p in (x.prepare(cycle) for x in self.preparers) if p is not None]
        if len(work) <= 1:
            return work[0] if work else None
        return Preparation(
            run=lambda: _call_each(w.run for w in work),
            skip=lambda: _call_each(w.skip for w in work),
        )

    def schedule(self, cycle: Cycle, pods: Sequence[Pod]) -> list[Pod]:
        """Rank the pods that may serve ``cycle``'s model, best first (one pass).

        Raises:
            ModelNotFound: no pod serves the model.
            NoReadyPods: pods serve the model but none is ready.
            NoCapacity: the filters removed every ready pod.
        """
        table = self.table(pods)
        candidates = table.candidates(cycle.request.model).all
        return table.take(self._rank(cycle, table, self._filter(cycle, table, candidates)))

    def schedule_request(
        self, cycle: Cycle, pods: Sequence[Pod], limit: int | None = None
    ) -> Schedule:
        """``schedule`` plus prefill/decode passes and session sticky (module doc).
        ``limit``: only the best ``limit`` pods are wanted (the pick and its fallbacks),
        the same ones in the same order as the whole ranking's first."""
        return self._schedule_request(cycle, self.table(pods), None, limit)

    def explain(self, cycle: Cycle, pods: Sequence[Pod]) -> Explanation:
        """What ``schedule_request`` would decide now, with every filter's and scorer's
        part (``Trace``): the same code, traced. Nothing is recorded, credited, timed or
        observed (``record``, ``arriving`` and the plugin timer are not called, and the
        cycle is ``explaining``: plugins observe no metric); the plugins' slow
        preparation (tokenizing) runs here. Ties are drawn from ``rng`` as for a request.
        """
        cycle.explaining = True
        work = self.prepare(cycle)
        if work is not None:
            work.run()
        trace = Trace()
        try:
            schedule = self._schedule_request(cycle, self.table(pods), trace)
        except ExtProcError as exc:
            return Explanation(None, trace, exc)
        return Explanation(schedule, trace, None)

    def _schedule_request(
        self, cycle: Cycle, table: PodTable, trace: Trace | None, limit: int | None = None
    ) -> Schedule:
        candidates = table.candidates(cycle.request.model)
        if self.pd_group is not None:
            return self._schedule_groups(cycle, table, candidates.all, self.pd_group, trace)
        if not len(candidates.serving):
            raise NoReadyPods(
                f"model {cycle.request.model!r} has ready prefill pods but no ready decode pod"
            )
        if trace is not None:
            trace.begin("serving", table, candidates.serving)
        serving = self._filter(cycle, table, candidates.serving, trace)
        prefill = candidates.prefill
        if len(prefill):
            if trace is not None:
                trace.begin("prefill", table, prefill)
            prefill = self._filter(cycle, table, prefill, trace)
        binding = self._binding(cycle)
        if binding is not None:
            bound = _find(table, serving, binding.pod)
            bound_prefill = _find(table, prefill, binding.prefill) if binding.prefill else None
            if bound is not None and (bound_prefill is not None or not len(prefill)):
                rest = self._shuffled(table.take(np.delete(serving, bound)))
                if trace is not None:
                    trace.pinned = True
                return Schedule(
                    [table.pods[serving[bound]], *rest],
                    None if bound_prefill is None else table.pods[prefill[bound_prefill]],
                    pinned=True,
                )
        best_prefill = None
        if len(prefill):
            if trace is not None:
                trace.resume("prefill")
            best_prefill = table.pods[self._rank(cycle, table, prefill, trace)[0]]
        if trace is not None:
            trace.resume("serving")
        ranked = self._rank(cycle, table, serving, trace, limit)
        return Schedule(table.take(ranked[:limit]), best_prefill)

    def _schedule_groups(
        self, cycle: Cycle, table: PodTable, ready: Positions, pd: PDGroup, trace: Trace | None
    ) -> Schedule:
        """PD groups: decode pods ranked, each paired with its group's best prefill pod."""
        cols = pd.columns(table)
        model = cycle.request.model
        decode = ready[cols.is_decode[ready]]
        if not len(decode):
            raise NoReadyPods(
                f"model {model!r} has no ready decode pod in a PD group "
                f"(label {pd.group_key!r} and the decodeLabels)"
            )
        if trace is not None:
            trace.begin("decode", table, decode)
        decode = self._filter(cycle, table, decode, trace)
        prefill = ready[cols.is_prefill[ready]]
        binding = self._binding(cycle)
        if binding is not None and binding.prefill is not None:
            bound = _find(table, decode, binding.pod)
            if bound is not None:
                group = cols.group[decode[bound]]
                mates = self._group_prefill(cycle, table, prefill, cols, group, trace)
                at = None if mates is None else _find(table, mates, binding.prefill)
                if mates is not None and at is not None:
                    rest = decode[(cols.group[decode] == group) & (decode != decode[bound])]
                    if trace is not None:
                        trace.pinned = True
                    return Schedule(
                        [table.pods[decode[bound]], *self._shuffled(table.take(rest))],
                        table.pods[mates[at]],
                        pinned=True,
                    )
        if trace is not None:
            trace.resume("decode")
        ranked = self._rank(cycle, table, decode, trace)
        best: dict[str, Pod | None] = {}
        for row in ranked.tolist():
            group = cols.group[row]
            if group not in best:
                mates = self._group_prefill(cycle, table, prefill, cols, group, trace)
                best[group] = (
                    None if mates is None else table.pods[self._rank(cycle, table, mates, trace)[0]]
                )
            pair = best[group]
            if pair is not None:
                return Schedule(table.take(ranked[cols.group[ranked] == group]), pair)
        raise NoReadyPods(
            f"no valid prefill-decode pod pairs found for model {model!r}: no ready prefill "
            "pod left in the group of any decode pod"
        )

    def _group_prefill(
        self,
        cycle: Cycle,
        table: PodTable,
        prefill: Positions,
        cols: PDColumns,
        group: str,
        trace: Trace | None = None,
    ) -> Positions | None:
        """The prefill pods of ``group`` that pass the filters, or None (Kthena skips the
        decode pod then: "prefill pods were filtered out")."""
        mates = prefill[cols.group[prefill] == group]
        if not len(mates):
            return None
        if trace is not None:
            trace.begin(f"prefill of group {group}", table, mates)
        try:
            return self._filter(cycle, table, mates, trace)
        except NoCapacity:
            return None

    def table(self, pods: Sequence[Pod]) -> PodTable:
        """``pods`` as a ``PodTable``: kept while the same tuple comes back (a snapshot:
        a tuple of frozen pods cannot change), built afresh for anything else."""
        table = self._table
        if table is not None and table.pods is pods:
            return table
        table = PodTable(pods, previous=self._table)
        if table.pods is pods:  # tuple(pods) is pods: it was a tuple
            self._table = table
        return table

    def _shuffled(self, pods: list[Pod]) -> list[Pod]:
        """``pods`` in random order (``rng.shuffle`` up to ``SMALL_RANK``, see ``_order``)."""
        if len(pods) <= SMALL_RANK:
            self.rng.shuffle(pods)
            return pods
        shuffled: list[Pod] = [pods[i] for i in self._generator().permutation(len(pods))]
        return shuffled

    def _generator(self) -> np.random.Generator:
        """The tie-break generator, seeded from ``rng`` (again if ``rng`` is replaced)."""
        cached = self._np_rng
        if cached is None or cached[0] is not self.rng:
            cached = self._np_rng = (self.rng, np.random.default_rng(self.rng.getrandbits(128)))
        return cached[1]

    def _binding(self, cycle: Cycle) -> Binding | None:
        key = cycle.request.session_key
        return self.sessions.get(key) if key and self.sessions is not None else None

    def _filter(
        self, cycle: Cycle, table: PodTable, candidates: Positions, trace: Trace | None = None
    ) -> Positions:
        if self._filter_steps[0] is not self.filters:
            self._filter_steps = (self.filters, tuple(map(table_filter, self.filters)))
        timer = self.timer if trace is None else None
        for f, step in zip(self.filters, self._filter_steps[1], strict=True):
            started = time.perf_counter()
            candidates = step(cycle, table, candidates)
            if timer is not None:
                timer.observe(f.type_name, "filter", time.perf_counter() - started)
            if trace is not None:
                trace.filtered(f.type_name, candidates)
            if not len(candidates):
                raise NoCapacity(
                    f"no pod can take the request now: filter {f.type_name!r} removed "
                    f"every pod serving model {cycle.request.model!r}"
                )
        return candidates

    def _rank(
        self,
        cycle: Cycle,
        table: PodTable,
        candidates: Positions,
        trace: Trace | None = None,
        limit: int | None = None,
    ) -> Positions:
        """``candidates`` by total score, best first; equal totals in random order. With
        ``limit`` (and no trace, which shows the whole order) at least the best
        ``limit``, maybe only those."""
        cycle.precise_matches = None  # matched anew for this ranking's candidates
        timer = self.timer if trace is None else None
        verbose = log.isEnabledFor(logging.DEBUG)
        if self._score_steps[0] is not self.scorers:
            self._score_steps = (
                self.scorers,
                tuple(table_scorer(ws.scorer) for ws in self.scorers),
                [ws.weight for ws in self.scorers],
            )
        scores_of: list[Scores] = []
        for ws, step in zip(self.scorers, self._score_steps[1], strict=True):
            started = time.perf_counter()
            scores = step(cycle, table, candidates)
            if timer is not None:
                timer.observe(ws.scorer.type_name, "score", time.perf_counter() - started)
            if trace is not None:
                trace.scored(ws.scorer.type_name, ws.weight, candidates, scores)
            scores_of.append(scores)
            if verbose:
                _log_scores(ws.scorer.type_name, table, candidates, scores)
        busy, routed = self._load_columns(table)
        weights = self._score_steps[2]
        shuffled = None
        if trace is None and not verbose:
            # The usual cases in one kernel call each: what the lines below do.
            if len(candidates) <= SMALL_RANK:
                return rank_few(scores_of, weights, candidates, busy, routed, self.rng.random)
            if limit is not None and limit * PARTIAL_RANK_FACTOR < len(candidates):
                shuffled = self._generator().permutation(len(candidates))
                best = rank_best(scores_of, weights, candidates, busy, routed, shuffled, limit)
                if best is not None:
                    return best
        totals = np.zeros(len(candidates), dtype=np.int64)
        for ws, scores in zip(self.scorers, scores_of, strict=True):
            totals += ws.weight * scores
        if verbose:
            _log_totals(table, candidates, totals)
        load = np.maximum(table.rows(busy, candidates), table.rows(routed, candidates))
        order = candidates[self._order(totals, load, shuffled)]
        if trace is not None:
            trace.ranked(candidates, totals, load, order)
        return order

    def _load_columns(self, table: PodTable) -> tuple[Scores, Scores]:
        """Per row of ``table``, what a pod's load (module doc) is the larger of: waiting
        + running as scraped, and the requests in flight (the first again without them)."""
        busy: Scores = table.memo("waiting + running", lambda: table.waiting + table.running)
        if self.in_flight is None:
            return busy, busy
        return busy, self.in_flight.requests_at(table.position, len(table))

    def _order(self, totals: Scores, load: Scores, shuffled: Positions | None = None) -> Positions:
        """Indices of ``totals``, highest first; equal totals least ``load`` first, then
        in random order.

        Up to ``SMALL_RANK`` candidates, one ``rng.random()`` per candidate breaks the
        remaining ties (a seeded run, e.g. the offline simulator's, repeats its picks).
        Beyond, a stable sort of a random permutation (``shuffled`` if already drawn) by
        (total, load) leaves equal keys in random order; ``kernels.rank_best`` gives the
        first few of that order without sorting them all.
        """
        if len(totals) <= SMALL_RANK:
            tiebreak = np.array([self.rng.random() for _ in range(len(totals))])
            small: Positions = np.lexsort((tiebreak, load, -totals))
            return small
        if shuffled is None:
            shuffled = self._generator().permutation(len(totals))
        order: Positions = shuffled[np.lexsort((load[shuffled], -totals[shuffled]))]
        return order

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

    @property
    def block_geometries(self) -> tuple[tuple[int, int], ...]:
        """The block geometries the recorders learn from: what a record made here must
        carry for another replica to apply it (``routing.records``)."""
        geometries = []
        for recorder in self.recorders:
            if isinstance(recorder, BlockRecorder) and recorder.block_geometry not in geometries:
                geometries.append(recorder.block_geometry)
        return tuple(geometries)

    def arriving(self, cycle: Cycle, pod: PodId) -> None:
        """``pod`` was picked for ``cycle``: the plugins that credit a pick at once do."""
        for plugin in self.provisional:
            plugin.arriving(cycle, pod)

    def settled(self, cycle: Cycle, pod: PodId) -> None:
        """The request picked for ``pod`` ended, however: its provisional credit goes."""
        for plugin in self.provisional:
            plugin.settled(cycle, pod)

    def pods_changed(self, pods: Sequence[Pod]) -> None:
        """A new snapshot: its table is built now, not by the next request."""
        self.table(pods)
        for listener in self.listeners:
            listener.pods_changed(pods)
        if self.sessions is not None:
            self.sessions.forget_pods({p.id for p in pods})


def _call_each(calls: Iterable[Callable[[], None]]) -> None:
    for call in calls:
        call()


def _find(table: PodTable, candidates: Positions, pod_id: PodId) -> int | None:
    """Where ``pod_id`` is in ``candidates``, or None."""
    row = table.position.get(pod_id)
    if row is None:
        return None
    where = np.flatnonzero(candidates == row)
    return int(where[0]) if len(where) else None


def _log_scores(name: str, table: PodTable, candidates: Positions, scores: Scores) -> None:
    """Kthena's ``--v=4`` lines: the plugin, then one line per candidate pod."""
    log.debug("ScorePlugin: %s", name)
    for row, score in zip(candidates.tolist(), scores.tolist(), strict=True):
        log.debug("Pod: %s, Score: %d", table.ids[row], score)


def _log_totals(table: PodTable, candidates: Positions, totals: Scores) -> None:
    """Kthena's ``--v=4`` summary after the plugins: each pod's weighted total."""
    log.debug("Final Pod Scores:")
    for row, total in zip(candidates.tolist(), totals.tolist(), strict=True):
        log.debug("  Pod: %s, Final Score: %d", table.ids[row], total)
