"""estimated-ttft (Score, ours; the shipped default): the pod expected to answer first.

The prefix-reuse cost model (``reference/prefix-reuse-lab.txt``): a request's time to
first token on a pod is the wait behind the work queued there plus the prefill of the
prompt tokens the pod does not hold. Per candidate pod::

    matched  = prompt tokens the pod holds: its longest recorded or arriving prefix
               (exact from precise-prefix-cache when configured; see below)
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
conversation to one pod).

Sessions: the cache a conversation is worth is the history it is about to grow, not the
prefix it reuses now. ``SessionBook`` tells which conversation a request continues (its
session header, else the earlier prompt it extends) and counts each pod's live
*returning* sessions (those that sent a second request: one-shot requests sharing a
system prompt are not conversations). Every pod's cost then gets, after the hysteresis::

    session_ms = sessionMs * weight * sessions(pod) / mean
    mean       = max(1, mean sessions of the candidates)
    weight     = min(1, mean * share)

where ``sessions`` leaves out the request's own session on its own pod, and ``share`` is
the part of the candidates' KV caches (``vllm:cache_config_info``) the latest prompts of
their live returning sessions fill (1 where a candidate's cache size is unknown): while
a few short conversations fill little of the caches, spreading them would only make
each pod recompute what they share, so the term fades; many sessions, or long ones,
weigh in full. A new
conversation goes where fewest live ones grow; one placed on a crowded pod moves once
the crowding costs more than recomputing its history elsewhere (its uncached tokens
there, and the margin), early while its history is short. Moving makes the new pod
hold its longest prefix, so it does not move back unless the other pod becomes the
crowded one (``extproc_sessions_moved_total``, and the tokens the moves prefill).

The hold: a request continuing a conversation (returning or on its second turn) goes to
the pod holding its history, its cost put under every other pod's (``held_cost``), while
that pod showed no waiting request at its last scrape and the latest prompts of the live
returning sessions placed there fill less than ``sessionHoldShare`` of its KV cache (no
hold where the cache size is unknown). Below that, staying costs no cache turnover and
nothing waits, while a move recomputes the history for certain: the estimate's other
terms (a write cost, requests routed since the scrape counted as queued) would move it
for a few ms. Past it, or with a queue, the cost model above decides.

LoRA adapters: a request for an adapter (a model some pod lists among its ``adapters``)
waits on a pod where the adapter is not active for it to be loaded, and, where every
slot is taken, for a slot to free (vLLM's ``vllm:lora_requests_info``: ``PodMetrics.lora``,
with the adapters this replica routed to the pod lately counted active; the states as
``scheduling.plugins.lora_rows`` tells them). Every pod's cost then gets,
last::

    lora_ms = 0                                           active (requests running with it)
            | loraLoadMs                                  a free slot, or no LoRA metric
            | loraLoadMs + loraSlotWaitMs                 slots full, the adapter queued there
            | loraLoadMs + loraSlotWaitMs * (1 + queued)  slots full with other adapters

where ``queued`` is the adapters queued there for a slot ahead of it (waiting, none of
their requests running): each takes a freed slot first. A queued adapter is not yet
loaded, so the request still waits for its load (the requests queued with it, which
will pay it, are the queue term's), but for one slot only. A pod without the metric is
taken to have a free slot (it lists the adapter, so it can load it). A term that is the
same on every candidate changes no score and is left out; a request for a base model has
none.

``score = floor(100 * (max_cost - cost) / (max_cost - min_cost))`` (all 100 when
equal). Ties are the scheduler's (least loaded first).

The prefix view is this plugin's own per-pod LRU (``PrefixIndex``, Kthena's block hashing
and eviction), recorded on success only, in bytes of the prompt: ``uncached =
ceil((prompt bytes - held bytes) / 4)``, the prompt's tokens ``ceil(prompt bytes / 4)``
and the match's share ``held bytes / prompt bytes``. Between the pick and the end of a
request its blocks are *arriving* at the picked pod (``Arrivals``): they count as held
there for the next requests' scoring and are dropped when the request ends, however it
ends; success then records them in the index for the pod that served.

With ``precise-prefix-cache`` configured too (``PluginContext.exact``), ``matched`` and
the prompt's tokens are its exact counts, from the pods' own KV events (with its own
provisional credit for picks whose events have not come yet), and the share is ``matched
/ prompt tokens``. Where it has none, this plugin's view answers, exactly where
precise-prefix-cache falls back: every pod of a request it cannot tokenize (in bytes, as
above), a pod whose view is stale (``matched = prompt tokens * held bytes / prompt
bytes``, so every pod of the request is counted in the same tokens). The rest of the
arithmetic (the queue, the write cost, the hysteresis) is the same either way.

Side output: the candidates' uncached tokens in the cycle (``Cycle.num_prefill_tokens``),
which the router passes to ``InFlight.start`` for its pick.

The scheduler scores with ``score_table`` (whole NumPy columns of the pod snapshot, one
index match over the candidates' rows, and precise-prefix-cache's counts for them when it
is configured); ``score`` is the same arithmetic pod by pod.
Metrics: the spec's prefix-cache series for this view (``scheduling.plugins.prefix_metrics``: the
match ratio counts a prefix held or arriving), the arriving requests and the entries.
"""

from __future__ import annotations

import threading
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar, NamedTuple

import numpy as np
import numpy.typing as npt
from prometheus_client import Counter, Gauge

from extproc.kernels import ttft_costs
from extproc.kernels.pure import Prices, session_weight
from extproc.pods import LoraSlots, Pod, PodId
from extproc.prefix.hashing import Keys
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.args import ZERO_UP, arg, load_args
from extproc.scheduling.interfaces import (
    BYTES_PER_TOKEN,
    Cycle,
    ExactMatches,
    PluginContext,
    PodTerms,
    RecordTimes,
    Scores,
    ViewState,
)
from extproc.scheduling.plugins.adopt import same_geometry
from extproc.scheduling.plugins.arrivals import Arrivals
from extproc.scheduling.plugins.lora_rows import (
    ACTIVE,
    FREE,
    UNKNOWN,
    WAITING,
    RoutedAdapters,
    is_adapter,
    queued_adapters,
    slots_per_row,
    state,
)
from extproc.scheduling.plugins.pod_work import pod_work, work_terms
from extproc.scheduling.plugins.prefix_metrics import prefix_cache_metrics
from extproc.scheduling.plugins.prefix_rows import match_lengths, per_row
from extproc.scheduling.plugins.session_book import SessionBook, SessionPrompt
from extproc.scheduling.podtable import PodTable, Positions, RowValues
from extproc.scheduling.shared_metrics import shared_metric


@dataclass(frozen=True, slots=True)
class EstimatedTTFTArgs:
    blockSizeToHash: int = arg(64, "Bytes of the prompt per block of the prefix view.")
    # 512 blocks: 32 KB of prompt, so long chat histories still tell pods apart
    maxBlocksToMatch: int = arg(
        512, "Blocks hashed per prompt: its first blockSizeToHash x maxBlocksToMatch bytes."
    )
    maxHashCacheSize: int = arg(
        50000,
        "Blocks recorded per pod (fewer for a pod whose KV cache holds fewer: "
        "vllm:cache_config_info); beyond, the least recently used are evicted.",
    )
    prefillMsPerToken: float = arg(
        0.02, "Milliseconds of one engine step per uncached prompt token (the prefill speed)."
    )
    queuedMs: float = arg(
        30.0, "Milliseconds each request queued ahead adds beyond its prefill (steps, a slot)."
    )
    runningMs: float = arg(
        15.0, "Milliseconds each running request adds (its decode share of each step)."
    )
    affinityMarginMs: float = arg(
        50.0,
        "The pods holding the longest match yield the request only when their estimate "
        "exceeds the best other pod's by more than this many ms (0: the ratio alone) ...",
        within=ZERO_UP,
    )
    affinityRatio: float = arg(1.5, "... and by more than this many times.")
    affinityMinMatch: float = arg(0.3, "No affinity for a match under this share of the prompt.")
    writtenMs: float = arg(
        100.0,
        "The most a pod's recent cache writes add to its estimate, in ms: a whole uncached "
        "prompt on the busiest writer (0: no write cost).",
        within=ZERO_UP,
    )
    writtenWindow: int = arg(
        1000, "Picks over which each pod's cache writes are counted (decayed)."
    )
    sessionMs: float = arg(
        150.0,
        "What a pod holding the candidates' mean number of live returning sessions (besides "
        "the request's own) adds to its estimate, in ms, in proportion, at full weight: "
        "weighed by min(1, that mean x the share of the candidates' KV caches their latest "
        "prompts fill) (0: sessions ignored).",
        within=ZERO_UP,
    )
    sessionIdleS: float = arg(
        120.0, "Seconds after its latest request a session stops counting as live."
    )
    sessionHoldShare: float = arg(
        0.5,
        "A conversation's request goes to the pod holding its history while that pod "
        "showed no waiting request at its last scrape and the live returning sessions "
        "placed there fill less than this share of its KV cache (0: no hold).",
        within=ZERO_UP,
    )
    # 50 ms, the simulated pods' (sim.engine's lora_load_ms): a rank-16 adapter of an 8B
    # model, ~80 MB of bf16 safetensors read at ~2 GB/s from the page cache, then copied
    # into the GPU slot. Measure the pods' own and set it.
    loraLoadMs: float = arg(
        50.0,
        "Milliseconds a pod takes to load a LoRA adapter that is not active there "
        "(0: adapters ignored).",
        within=ZERO_UP,
    )
    # A slot frees when the last running request of one adapter ends: a few hundred
    # tokens of decode at 20-40 ms each, about a second.
    loraSlotWaitMs: float = arg(
        1000.0,
        "Milliseconds a request for an adapter waits for a slot, per adapter ahead of it, "
        "on a pod whose adapter slots are all taken.",
        within=ZERO_UP,
    )


class Written:
    """Uncached prompt tokens each pod was picked to prefill (so to write into its cache),
    decayed by ``1 - 1/window`` at every pick. Thread-safe.

    Every pod decays alike, so the values are kept multiplied by a factor common to all
    (``decay ** -picks``): a pick adds its tokens times that factor, and nothing decays
    pod by pod. The write cost reads only each pod's share of the most written, which the
    factor does not change (``relative``, ``relative_rows``); ``get`` divides it out.
    """

    REBASE = 1e150  # past this factor the values are divided by it (it would overflow)

    def __init__(self, window: int) -> None:
        self.decay = 1.0 - 1.0 / window
        self._scale = 1.0  # the common factor: what a token written now weighs
        self._pods: dict[PodId, float] = {}
        # The values of one pod table's rows (its ``position``), kept up to date by ``add``
        # and rebuilt when the table's pods change: no step per pod on the request path.
        self._rows: tuple[Mapping[PodId, int], npt.NDArray[np.float64]] | None = None
        self._lock = threading.Lock()

    def add(self, pod: PodId, tokens: int) -> None:
        with self._lock:
            if self.decay == 0.0:  # a window of 1: only the last pick counts
                self._pods = {}
                if self._rows is not None:
                    self._rows[1][:] = 0.0
            else:
                self._scale /= self.decay
                if self._scale > self.REBASE:
                    self._rebase()
            weighted = tokens * self._scale
            self._pods[pod] = self._pods.get(pod, 0.0) + weighted
            if self._rows is not None and (row := self._rows[0].get(pod)) is not None:
                self._rows[1][row] += weighted

    def _rebase(self) -> None:
        scale, self._scale = self._scale, 1.0
        self._pods = {pod: v / scale for pod, v in self._pods.items()}
        if self._rows is not None:
            self._rows[1][:] /= scale

    def set_window(self, window: int) -> None:
        """Decay by ``1 - 1/window`` from the next pick on (a reload)."""
        with self._lock:
            self.decay = 1.0 - 1.0 / window

    def get(self, pod: PodId) -> float:
        """Tokens written to ``pod``, decayed."""
        with self._lock:
            return self._pods.get(pod, 0.0) / self._scale

    def relative(self, pods: Iterable[PodId]) -> dict[PodId, float]:
        """Each pod's written tokens times the common factor."""
        with self._lock:
            return {pod: self._pods.get(pod, 0.0) for pod in pods}

    def relative_rows(self, rows: Mapping[PodId, int], num_rows: int) -> npt.NDArray[np.float64]:
        """``relative`` per row of a pod table (``rows``: its pod -> row; others 0)."""
        with self._lock:
            if self._rows is None or self._rows[0] is not rows:
                values = np.zeros(num_rows, dtype=np.float64)
                for pod, v in self._pods.items():
                    if (row := rows.get(pod)) is not None:
                        values[row] = v
                self._rows = (rows, values)
            return self._rows[1].copy()

    def forget_pods(self, keep: set[PodId]) -> None:
        with self._lock:
            self._pods = {pod: v for pod, v in self._pods.items() if pod in keep}
            self._rows = None


HOLD_MS = 1.0  # the least the hold puts a conversation's pod under the cheapest other


def held_cost(cost: float, others: npt.NDArray[np.float64]) -> float:
    """The held pod's cost (module doc): under the cheapest other pod by ``HOLD_MS`` and a
    99th of the others' range, so that in whole scores it alone scores highest."""
    lo, hi = float(others.min()), float(others.max())
    return min(cost, lo - HOLD_MS - (hi - lo) / 99)


def holds(held_bytes: float, capacity_tokens: float, share: float) -> bool:
    """The hold's cache rule (module doc): the live returning sessions' latest prompts
    (``held_bytes``) fill less than ``share`` of the pod's KV cache (tokens; none known:
    no hold)."""
    return capacity_tokens > 0 and held_bytes / BYTES_PER_TOKEN < share * capacity_tokens


def _kv_capacities(pods: Sequence[Pod]) -> npt.NDArray[np.float64]:
    """Each pod's KV cache in tokens (``vllm:cache_config_info``), 0 where unknown."""
    return np.fromiter((p.metrics.kv_capacity_tokens or 0 for p in pods), np.float64, len(pods))


def _capacity_rows(table: PodTable) -> npt.NDArray[np.float64]:
    """``_kv_capacities`` per row of the table, once per snapshot."""
    return table.memo(_CAPACITY, lambda: _kv_capacities(table.pods))


def _min_max_scores(costs: npt.NDArray[np.float64]) -> Scores:
    """The cheapest 100, the dearest 0 (``kernels.ttft_costs``'s rule)."""
    lo, hi = costs.min(), costs.max()
    if hi == lo:
        return np.full(len(costs), 100, dtype=np.int64)
    scores: Scores = (100 * (hi - costs) / (hi - lo)).astype(np.int64)
    return scores


class PromptLength(NamedTuple):
    """The prompt's length in the unit the pods' matches are counted in (module doc):
    bytes, ``BYTES_PER_TOKEN`` to a token, or exact tokens (precise-prefix-cache's)."""

    units: int
    units_per_token: int

    @property
    def num_tokens(self) -> int:
        return -(-self.units // self.units_per_token)

    def uncached(self, held: int) -> int:
        """Tokens a pod holding ``held`` units of the prompt's start would prefill."""
        return -(-(self.units - held) // self.units_per_token)


_SIZED = "estimated-ttft sized the view"  # a pod table's scratch key
_CAPACITY = "estimated-ttft: KV cache tokens per row"  # a pod table's scratch key
_NO_SESSIONS = np.empty(0, dtype=np.float64)  # the kernel reads none without a session price


# The arguments that shape the view (the first two: the arriving prompts' keys too).
VIEW_ARGS = ("blockSizeToHash", "maxBlocksToMatch", "maxHashCacheSize")


class EstimatedTTFT:
    """Scores pods by estimated time to first token, with affinity hysteresis."""

    type_name: ClassVar[str] = "estimated-ttft"
    args_type: ClassVar[type[EstimatedTTFTArgs]] = EstimatedTTFTArgs

    def __init__(self, args: EstimatedTTFTArgs, ctx: PluginContext) -> None:
        self.args = args
        self.prices = Prices(
            args.prefillMsPerToken,
            args.queuedMs,
            args.runningMs,
            args.writtenMs,
            args.affinityMinMatch,
            args.affinityMarginMs,
            args.affinityRatio,
            args.sessionMs,
        )
        self.in_flight = ctx.in_flight
        self.exact = ctx.exact
        self.metrics = prefix_cache_metrics(ctx.registry)
        self.index = PrefixIndex(args.maxHashCacheSize, observer=self.metrics)
        self.arrivals = Arrivals()
        self.recorded = RecordTimes()  # for ``pod_view``
        self.written = Written(args.writtenWindow)
        self.sessions = SessionBook(args.sessionIdleS)
        self.routed = RoutedAdapters()  # the adapters routed to each pod lately
        registry = ctx.registry  # its metrics are shared: a reload builds it again
        self.sessions_moved = shared_metric(
            registry,
            Counter,
            "extproc_sessions_moved",
            "Sessions picked for another pod than the one that served their previous request.",
        )
        self.sessions_held = shared_metric(
            registry,
            Counter,
            "extproc_sessions_held",
            "Requests of a conversation picked for the pod holding its history by the hold "
            "(sessionHoldShare) where the estimate alone ranked another pod first.",
        )
        self.moved_tokens = shared_metric(
            registry,
            Counter,
            "extproc_sessions_moved_recomputed_tokens",
            "Prompt tokens the pods picked for moved sessions were estimated to prefill.",
        )
        shared_metric(
            registry,
            Gauge,
            "extproc_sessions_live",
            "Sessions (conversations) seen within sessionIdleS.",
        ).set_function(lambda: len(self.sessions))
        shared_metric(
            registry,
            Gauge,
            "extproc_estimated_ttft_arriving_requests",
            "Routed requests whose prompt counts as arriving at their pick (not ended yet).",
        ).set_function(lambda: self.arrivals.num_requests)
        shared_metric(
            registry,
            Gauge,
            "extproc_estimated_ttft_entries",
            "Prefix-view entries (blocks per pod) recorded by estimated-ttft.",
        ).set_function(lambda: self.index.num_entries)

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> EstimatedTTFT:
        return cls(load_args(cls.args_type, args), ctx)

    def adopt(self, previous: object) -> bool:
        """``Reloadable``: the recorded view and the arriving prompts, each when the
        arguments that shape it are unchanged; the cache writes and the sessions always
        (their new window and idle time apply from now on)."""
        if not isinstance(previous, EstimatedTTFT):
            return False
        name, old, new = self.type_name, previous.args, self.args
        kept_view = same_geometry(name, "prefix view", old, new, VIEW_ARGS)
        if kept_view:
            self.index, self.recorded = previous.index, previous.recorded
        else:
            self.metrics.entries_changed(-previous.index.num_entries)  # no longer held
        kept_arrivals = same_geometry(name, "arriving prompts", old, new, VIEW_ARGS[:2])
        if kept_arrivals:
            self.arrivals = previous.arrivals
        self.written = previous.written
        self.written.set_window(new.writtenWindow)
        self.sessions = previous.sessions
        self.sessions.idle_s = new.sessionIdleS
        self.routed = previous.routed
        return kept_view and kept_arrivals

    @property
    def block_geometry(self) -> tuple[int, int]:
        """A ``BlockRecorder``: its records are the prompt's keys of this geometry, so
        they travel to other replicas (``routing.records``)."""
        return self.args.blockSizeToHash, self.args.maxBlocksToMatch

    def _keys(self, cycle: Cycle) -> Keys:
        return cycle.block_keys(self.args.blockSizeToHash, self.args.maxBlocksToMatch)

    def matched_blocks(self, cycle: Cycle, pods: Sequence[Pod]) -> dict[PodId, int]:
        """Per pod of ``pods``, the longest prefix it holds or has arriving, in blocks."""
        keys = self._keys(cycle)
        if not len(keys):
            return {}
        ids = [p.id for p in pods]
        return self._with_arrivals(keys, self.index.match(keys, ids, len(ids)), set(ids))

    def _with_arrivals(
        self, keys: Keys, held: dict[PodId, int], candidates: Container[PodId]
    ) -> dict[PodId, int]:
        """``held`` (recorded matches), raised to the candidates' arriving prefixes."""
        for pod, blocks in self.arrivals.match(keys).items():
            if blocks > held.get(pod, 0) and pod in candidates:
                held[pod] = blocks
        return held

    def matched_bytes(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        """``PrefixMatcher``: bytes of the prompt's start each pod holds (or will)."""
        return self._held_bytes(cycle, self.matched_blocks(cycle, pods))

    def _held_bytes(self, cycle: Cycle, held: Mapping[PodId, int]) -> dict[PodId, int]:
        size, limit = self.args.blockSizeToHash, cycle.num_prompt_bytes
        return {pod: min(blocks * size, limit) for pod, blocks in held.items()}

    def _exact(self, cycle: Cycle, pods: Sequence[Pod]) -> ExactMatches | None:
        """precise-prefix-cache's counts, when it is configured and has them."""
        return None if self.exact is None else self.exact.exact_matches(cycle, pods)

    def held(
        self, cycle: Cycle, pods: Sequence[Pod], blocks: Mapping[PodId, int]
    ) -> tuple[PromptLength, dict[PodId, int]]:
        """The prompt's length and what each pod holds of it (pods holding none may be left
        out), in bytes or exact tokens (module doc); ``blocks`` is ``matched_blocks``."""
        held_bytes = self._held_bytes(cycle, blocks)
        exact = self._exact(cycle, pods)
        if exact is None:
            return PromptLength(cycle.num_prompt_bytes, BYTES_PER_TOKEN), held_bytes
        num_tokens, held = exact.num_prompt_tokens, dict(exact.matched_tokens)
        num_bytes = max(1, cycle.num_prompt_bytes)
        for pod, n in held_bytes.items():
            if pod not in held:  # no exact view: this plugin's, in the prompt's tokens
                held[pod] = num_tokens * n // num_bytes
        return PromptLength(num_tokens, 1), held

    def estimate_ms(self, cycle: Cycle, pods: Sequence[Pod]) -> dict[PodId, float]:
        """Each pod's ``est_ms`` (module doc); records ``cycle.uncached_tokens``."""
        return self._estimates(
            cycle, pods, *self.held(cycle, pods, self.matched_blocks(cycle, pods))
        )

    def _estimates(
        self, cycle: Cycle, pods: Sequence[Pod], length: PromptLength, held: Mapping[PodId, int]
    ) -> dict[PodId, float]:
        a = self.args
        num_tokens = length.num_tokens
        estimates: dict[PodId, float] = {}
        for pod in pods:
            uncached = length.uncached(held.get(pod.id, 0))
            work = pod_work(cycle, pod, uncached, self.in_flight, num_tokens)
            estimates[pod.id] = (
                a.prefillMsPerToken * (work.queued * work.mean_tokens + work.uncached)
                + a.queuedMs * (1 + work.queued)
                + a.runningMs * pod.metrics.running
            )
        return estimates

    def write_ms(
        self, cycle: Cycle, pods: Iterable[PodId], num_tokens: int | None = None
    ) -> dict[PodId, float]:
        """Each pod's ``write_ms`` (module doc); needs ``estimate_ms`` run on the cycle.
        ``num_tokens``: the prompt's tokens (by default estimated from its bytes)."""
        written = self.written.relative(pods)
        most = max(written.values(), default=0.0)
        if most <= 0:
            return dict.fromkeys(written, 0.0)
        if num_tokens is None:
            num_tokens = cycle.num_prompt_tokens
        per_token = self.args.writtenMs / (most * max(1, num_tokens))
        return {pod: per_token * w * cycle.num_prefill_tokens(pod) for pod, w in written.items()}

    def session_ms(self, cycle: Cycle, pods: Sequence[Pod]) -> dict[PodId, float]:
        """Each pod's ``session_ms`` (module doc)."""
        ids = [p.id for p in pods]
        counts = self.sessions.returning_counts(ids)
        if self.args.sessionMs <= 0:
            return dict.fromkeys(counts, 0.0)
        own = self._own_pod(cycle)
        if own is not None and own in counts:
            counts[own] -= 1
        mean = max(1.0, sum(counts.values()) / max(1, len(counts)))
        weight = session_weight(mean, self.sessions.held_bytes(ids), _kv_capacities(pods))
        price = self.args.sessionMs * weight
        return {pod: price * n / mean for pod, n in counts.items()}

    def _session_prompt(self, cycle: Cycle) -> SessionPrompt:
        """What the session book reads of ``cycle``, made once a cycle; a cycle replayed
        from another replica has keys but no prompt."""
        keys = self._keys(cycle)
        prompt = cycle.session_prompt
        if prompt is None or prompt.keys is not keys:  # none yet, or of another geometry
            request = cycle.request
            data = request.prompt.encode() if cycle.num_prompt_bytes > 0 else None
            prompt = cycle.session_prompt = SessionPrompt(
                keys, self.args.blockSizeToHash, data, request.session_key
            )
        return prompt

    def _own_pod(self, cycle: Cycle) -> PodId | None:
        """The pod the request's session is placed on, if it is a returning one; what
        the book found stays on the cycle for ``arriving`` and ``_home``."""
        found = cycle.session_found = self.sessions.lookup(self._session_prompt(cycle))
        pod, returning = self.sessions.session_pod(found.session)
        return pod if returning else None

    def _home(self, cycle: Cycle) -> PodId | None:
        """The pod holding the request's conversation, returning or not (after
        ``_own_pod``), when the hold is on."""
        found = cycle.session_found
        if self.args.sessionHoldShare <= 0 or self.args.sessionMs <= 0 or found is None:
            return None
        return self.sessions.session_pod(found.session)[0]

    def _hold_pod(self, cycle: Cycle, pods: Sequence[Pod]) -> PodId | None:
        """The pod ``_costs`` ranks first by the hold (module doc), if any."""
        home = self._home(cycle)
        pod = next((p for p in pods if p.id == home), None)
        if pod is None or pod.metrics.waiting > 0:
            return None
        held = self.sessions.held_bytes([pod.id])
        capacity = pod.metrics.kv_capacity_tokens or 0
        return pod.id if holds(held, capacity, self.args.sessionHoldShare) else None

    def _costs(
        self, cycle: Cycle, pods: Sequence[Pod], blocks: Mapping[PodId, int]
    ) -> dict[PodId, float]:
        length, held = self.held(cycle, pods, blocks)
        estimates = self._estimates(cycle, pods, length, held)
        for pod, ms in self.write_ms(cycle, estimates, length.num_tokens).items():
            estimates[pod] += ms
        longest = max(held.values(), default=0)
        a = self.args
        if longest > 0 and longest / max(1, length.units) >= a.affinityMinMatch:
            for pod, units in held.items():
                if units == longest:
                    est = estimates[pod]
                    estimates[pod] = min(est - a.affinityMarginMs, est / a.affinityRatio)
        for pod, ms in self.session_ms(cycle, pods).items():
            estimates[pod] += ms
        lora = self.lora_ms(cycle, pods)
        if lora is not None and len(set(lora.values())) > 1:
            for pod, ms in lora.items():
                estimates[pod] += ms
        hold = self._hold_pod(cycle, pods)
        cycle.session_held = None
        if hold is not None and len(estimates) > 1:
            others = np.fromiter((ms for pod, ms in estimates.items() if pod != hold), np.float64)
            if estimates[hold] >= others.min():
                cycle.session_held = hold
            estimates[hold] = held_cost(estimates[hold], others)
        return estimates

    def lora_ms(self, cycle: Cycle, pods: Sequence[Pod]) -> dict[PodId, float] | None:
        """Each pod's ``lora_ms`` (module doc); None for a base model's request, or when
        ``loraLoadMs`` is 0."""
        adapter = cycle.request.model
        if self.args.loraLoadMs <= 0 or not any(adapter in p.adapters for p in pods):
            return None
        return {p.id: self._pod_lora_ms(self.routed.slots(p), adapter) for p in pods}

    def _pod_lora_ms(self, slots: LoraSlots | None, adapter: str) -> float:
        a = self.args
        at = state(slots, adapter)
        if at == ACTIVE:
            return 0.0
        if at in (FREE, UNKNOWN):
            return a.loraLoadMs
        slots_ahead = 1 if at == WAITING else 1 + queued_adapters(slots)
        return a.loraLoadMs + a.loraSlotWaitMs * slots_ahead

    def _lora_rows(
        self, cycle: Cycle, table: PodTable, positions: Positions
    ) -> npt.NDArray[np.float64] | None:
        """``lora_ms`` per row of ``positions``, from a column computed once per snapshot
        and adapter; None where ``lora_ms`` is."""
        adapter = cycle.request.model
        if self.args.loraLoadMs <= 0 or not is_adapter(table, adapter):
            return None

        column = slots_per_row(
            table, self.routed, lambda s: self._pod_lora_ms(s, adapter), np.float64
        )
        rows: npt.NDArray[np.float64] = column[positions]
        return rows

    def explain(self, cycle: Cycle, pods: Sequence[Pod]) -> list[PodTerms]:
        """``Explainer``: each pod's terms of ``cost`` (module doc), in ms and tokens, as
        ``score`` would weigh them now; changes nothing but ``cycle``'s side output (give
        it a cycle of its own)."""
        length, held = self.held(cycle, pods, self.matched_blocks(cycle, pods))
        num_tokens = length.num_tokens
        a = self.args
        base: dict[PodId, dict[str, float]] = {}
        for pod in pods:
            uncached = length.uncached(held.get(pod.id, 0))
            work = pod_work(cycle, pod, uncached, self.in_flight, num_tokens)
            prefill_ms = a.prefillMsPerToken * (work.queued * work.mean_tokens + work.uncached)
            queued_ms = a.queuedMs * (1 + work.queued)
            running_ms = a.runningMs * pod.metrics.running
            base[pod.id] = work_terms(pod, work, num_tokens, self.in_flight) | {
                "prefill_ms": prefill_ms,
                "queued_ms": queued_ms,
                "running_ms": running_ms,
                "est_ms": prefill_ms + queued_ms + running_ms,
            }
        write = self.write_ms(cycle, base, num_tokens)
        longest = max(held.values(), default=0)
        affine = longest > 0 and longest / max(1, length.units) >= a.affinityMinMatch
        sessions = self.session_ms(cycle, pods)
        lora = self.lora_ms(cycle, pods) or {}
        out = []
        for pod_id, terms in base.items():
            est = terms["est_ms"] + write.get(pod_id, 0.0)
            has_affinity = affine and held.get(pod_id, 0) == longest
            if has_affinity:
                est = min(est - a.affinityMarginMs, est / a.affinityRatio)
            terms["write_ms"] = write.get(pod_id, 0.0)
            terms["affinity"] = float(has_affinity)
            terms["session_ms"] = sessions.get(pod_id, 0.0)
            terms["lora_ms"] = lora.get(pod_id, 0.0)
            terms["cost_ms"] = est + terms["session_ms"] + terms["lora_ms"]
            terms["hold"] = 0.0
            out.append(PodTerms(pod_id, terms))
        hold = self._hold_pod(cycle, pods)
        if hold is not None and len(out) > 1:
            others = np.fromiter((t.terms["cost_ms"] for t in out if t.pod != hold), np.float64)
            terms = base[hold]
            terms["hold"] = 1.0
            terms["cost_ms"] = held_cost(terms["cost_ms"], others)
        return out

    def pod_view(self, pod: PodId) -> ViewState:
        """``ViewInspector``: the blocks recorded for ``pod`` and its last record's age."""
        return ViewState(self.index.num_pod_entries(pod), self.recorded.age(pod))

    def _size_view(self, table: PodTable) -> None:
        """Hold each pod's view to what its KV cache holds (``vllm:cache_config_info``),
        once per pod table: a view larger than the pod's cache credits histories the pod
        has evicted."""
        if table.scratch.get(_SIZED) is not self:
            table.scratch[_SIZED] = self
            self.size_view(table.pods)

    def size_view(self, pods: Iterable[Pod]) -> None:
        per_block = self.args.blockSizeToHash / BYTES_PER_TOKEN  # tokens in a view block
        for pod in pods:
            tokens = pod.metrics.kv_capacity_tokens
            self.index.limit_pod(pod.id, None if not tokens else int(tokens / per_block))

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        self.size_view(pods)
        held = self.matched_blocks(cycle, pods)
        self._observe(cycle, max(held.values(), default=0))
        costs = self._costs(cycle, pods, held)
        lo, hi = min(costs.values(), default=0.0), max(costs.values(), default=0.0)
        if hi == lo:
            return dict.fromkeys(costs, 100)
        return {pod: int(100 * (hi - cost) / (hi - lo)) for pod, cost in costs.items()}

    def score_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Scores:
        """``score`` on whole columns: the same arithmetic, in the same order, in float64
        (``tests/scheduling/plugins/test_estimated_ttft_table.py`` checks they agree)."""
        _, scores, longest = self._table_pass(cycle, table, positions)
        self._observe(cycle, longest)
        return scores

    def _table_pass(
        self, cycle: Cycle, table: PodTable, positions: Positions
    ) -> tuple[npt.NDArray[np.float64], Scores, int]:
        """The costs, the scores, and the longest prefix a candidate holds or has
        arriving in this plugin's view, in blocks; leaves the candidates' uncached tokens
        in ``cycle.uncached_rows``."""
        self._size_view(table)
        keys = self._keys(cycle)
        if len(keys):
            blocks = match_lengths(self.index, keys, table, positions)
            arriving = self.arrivals.match(keys)
            if arriving:
                np.maximum(blocks, per_row(table, positions, arriving), out=blocks)
        else:
            blocks = np.zeros(len(positions), dtype=np.int64)
        a = self.args
        num_bytes = cycle.num_prompt_bytes
        length = PromptLength(num_bytes, BYTES_PER_TOKEN)
        held = np.minimum(blocks * a.blockSizeToHash, num_bytes)
        exact = self._exact(cycle, table.take(positions)) if self.exact is not None else None
        if exact is not None:
            length, held = self._exact_rows(exact, table, positions, held, num_bytes)
        requests, tokens = self.in_flight.counts_at(table.position, len(table))
        written = self.written.relative_rows(table.position, len(table))
        sessions = held_rows = capacity = _NO_SESSIONS
        hold_row = -1
        if a.sessionMs > 0:
            sessions, held_rows = self.sessions.returning_rows(table.position, len(table))
            own = self._own_pod(cycle)
            if own is not None and (row := table.position.get(own)) is not None:
                sessions[row] -= 1
            hold_row = self._hold_row(cycle, table, held_rows)
            capacity = _capacity_rows(table)
        uncached = np.empty(len(positions), dtype=np.int64)
        costs = np.empty(len(positions), dtype=np.float64)
        scores = np.empty(len(positions), dtype=np.int64)
        ttft_costs(
            held,
            (length.units, length.units_per_token, length.num_tokens),
            positions,
            requests,
            tokens,
            table.waiting,
            table.running,
            written,
            sessions,
            held_rows,
            capacity,
            self.prices,
            uncached,
            costs,
            scores,
        )
        lora = self._lora_rows(cycle, table, positions)
        if lora is not None and len(lora) > 1 and lora.max() > lora.min():
            costs += lora
            scores = _min_max_scores(costs)
        cycle.session_held = None
        if hold_row >= 0 and len(costs) > 1:
            at = np.flatnonzero(positions == hold_row)
            if len(at):
                others = np.delete(costs, at[0])
                if costs[at[0]] >= others.min():
                    cycle.session_held = table.ids[hold_row]
                costs[at[0]] = held_cost(costs[at[0]], others)
                scores = _min_max_scores(costs)
        cycle.uncached_rows.append(RowValues(table, positions, uncached))
        return costs, scores, int(blocks.max(initial=0))

    def _hold_row(self, cycle: Cycle, table: PodTable, held_rows: npt.NDArray[np.float64]) -> int:
        """``_hold_pod``'s row in ``table`` (-1 for none), from the session book's rows."""
        home = self._home(cycle)
        row = -1 if home is None else table.position.get(home, -1)
        if row < 0 or table.waiting[row] > 0:
            return -1
        capacity = float(_capacity_rows(table)[row])
        return row if holds(float(held_rows[row]), capacity, self.args.sessionHoldShare) else -1

    @staticmethod
    def _exact_rows(
        exact: ExactMatches,
        table: PodTable,
        positions: Positions,
        held_bytes: npt.NDArray[np.int64],
        num_bytes: int,
    ) -> tuple[PromptLength, npt.NDArray[np.int64]]:
        """``held`` on the table path with precise-prefix-cache's counts: exact tokens per
        row, this plugin's view in the prompt's tokens where a pod has no exact view."""
        num_tokens, matched = exact.num_prompt_tokens, exact.matched_tokens
        held = num_tokens * held_bytes // max(1, num_bytes)
        if matched:
            known = per_row(table, positions, dict.fromkeys(matched, 1)).astype(np.bool_)
            held[known] = per_row(table, positions, matched)[known]
        return PromptLength(num_tokens, 1), held

    def _observe(self, cycle: Cycle, longest: int) -> None:
        """The spec's match ratio: the longest prefix held or arriving, over the blocks."""
        num_blocks = len(self._keys(cycle))
        if num_blocks and not cycle.explaining:
            self.metrics.observe_match(cycle.request.model, longest, num_blocks)

    def record(self, cycle: Cycle, pod: PodId) -> None:
        keys = self._keys(cycle)
        if len(keys):
            self.index.record(keys, pod, self.metrics.model_tag(cycle.request.model))
            self.recorded.mark(pod)

    def arriving(self, cycle: Cycle, pod: PodId) -> None:
        """``pod`` was picked for ``cycle``: its blocks count as held there until it ends."""
        keys = self._keys(cycle)
        self.written.add(pod, cycle.num_prefill_tokens(pod))
        if len(keys):
            self.arrivals.add(keys, pod)
        self.routed.arriving(cycle.request.model, pod)
        placed = self.sessions.place(self._session_prompt(cycle), pod, cycle.session_found)
        if cycle.session_held == pod:
            self.sessions_held.inc()
        if placed.moved_from is not None and cycle.num_prompt_bytes > 0:  # ours, not a replica's
            self.sessions_moved.inc()
            self.moved_tokens.inc(cycle.num_prefill_tokens(pod))

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
        self.sessions.forget_pods(ids)
        self.recorded.retain(ids)
        self.routed.pods_changed(pods)
