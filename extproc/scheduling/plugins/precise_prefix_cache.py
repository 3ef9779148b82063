"""precise-prefix-cache (Score): favour the pods whose KV cache holds the prompt's start,
as their own KV events say (``datalayer.kv_events`` -> ``prefix.precise.index``: the
process builds the events subscriber on this plugin's ``index`` and feeds it the pods).

* inputs: the request's exact token ids (``request.tokens``: the model's chat template
  and tokenizer from ``models: {name: directory}``), cut into the pod's block size (from
  its events, else ``blockSize``) and chained into ``prefix.precise.keys``;
* score = floor((GPU blocks + ``cpuWeight`` * offloaded blocks) / full blocks * 100)
  for at most ``topKMatches`` pods, from the longest match down; others 0, like
  prefix-cache;
* tokenizing (``Preparer``): ``prepare`` renders and cuts the prompt on the request's
  thread, and finishes there when the memo holds every segment; the encoding of new
  segments is left for the router to run on its tokenizing threads (``routing.
  preparing``), or to skip when they are full;
* fallback: a request that cannot be tokenized exactly (multimodal, a model without a
  tokenizer, a responses request continuing a stored one) or was not for lack of room
  (``busy``), and a pod whose view is stale (events lost) are scored from an approximate
  view, prefix-cache's own (``PrefixIndex`` over recorded prompts), which this plugin
  keeps too;
* exact counts for the cost model: ``exact_matches`` (``ExactPrefix``, which
  estimated-ttft reads) gives the prompt's length and, per pod with a trusted view, the
  tokens vLLM will find cached (whole blocks, never the prompt's last token); a pod whose
  match runs through blocks seeded from the view snapshot and not yet confirmed by its
  events (provisional) is left out, as not exact; ``matched_tokens`` adds the
  fallbacks' estimates, and the provisional matches as estimates;
* provisional credit: events come after the prefill, not at the pick, so from the pick
  until the request ends the prompt's blocks count as held on the picked pod
  (``Arrivals`` over this plugin's keys in ``blockSize`` blocks, kept in
  ``Cycle.credit_keys``, which another replica's pick brings along; the view's own match
  wins where it is longer). A stale pod gets no credit: it is scored approximately.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.errors import ConfigError
from extproc.pods import Pod, PodId, adapters_of
from extproc.prefix.hashing import Keys, as_keys
from extproc.prefix.index import PrefixIndex
from extproc.prefix.precise.index import PodView, PreciseIndex
from extproc.prefix.precise.keys import chain_keys
from extproc.request.tokens import NotExact, Segments, SegmentTokenizer, TokenIds
from extproc.scheduling.args import ExtraArg, arg, load_args
from extproc.scheduling.interfaces import (
    BYTES_PER_TOKEN,
    Cycle,
    ExactMatches,
    PluginContext,
    Preparation,
    RecordTimes,
    Scores,
    ViewState,
)
from extproc.scheduling.plugins.adopt import same_geometry
from extproc.scheduling.plugins.arrivals import Arrivals
from extproc.scheduling.plugins.prefix_metrics import MATCH_RATIO_BUCKETS
from extproc.scheduling.plugins.prefix_rows import per_row
from extproc.scheduling.podtable import PodTable, Positions
from extproc.scheduling.shared_metrics import per_registry, shared_metric

log = logging.getLogger("extproc.scheduling.precise")

TOKENIZE_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


class PreciseMatches(NamedTuple):
    """The prompt's blocks matched in each candidate's exact view, once per ranking."""

    pods: tuple[PodId, ...]  # the candidates matched
    # per pod with a trusted view: (GPU blocks, offloaded blocks, the prompt's blocks),
    # its credit for arriving blocks included
    blocks: dict[PodId, tuple[int, int, int]]
    stale: list[PodId]  # the pods whose view is stale: scored from the approximate view


@dataclass(frozen=True, slots=True)
class PreciseArgs:
    blockSize: int = arg(16, "Tokens per KV block, until a pod's events tell its own.")
    capacityBlocks: int = arg(
        200_000,
        "Blocks a pod's view holds at most, per medium (GPU, CPU); beyond, the "
        "oldest are dropped (counted: their removals were lost).",
    )
    staleSeconds: float = arg(
        30.0,
        "After lost events, a pod's view is distrusted (scored from the approximate "
        "view) for this many seconds.",
    )
    provisionalSeconds: float = arg(
        600.0,
        "Blocks seeded from the view snapshot at start and not confirmed by the pod's "
        "events are dropped after this many seconds.",
    )
    cpuWeight: float = arg(0.5, "An offloaded (CPU) block's worth against a GPU block.")
    topKMatches: int = arg(
        5, "At most this many pods score, those with the longest match; the others score 0."
    )
    memoTokens: int = arg(
        4_000_000, "Tokens of tokenized prompt segments memoized, shared among the models."
    )
    # The approximate view (prefix-cache's), for fallbacks:
    blockSizeToHash: int = arg(
        64, "Approximate view (for fallbacks): bytes of the prompt per hashed block."
    )
    maxBlocksToMatch: int = arg(128, "Approximate view: blocks hashed per prompt.")
    maxHashCacheSize: int = arg(50000, "Approximate view: blocks recorded per pod.")
    EXTRA_ARGS: ClassVar[tuple[ExtraArg, ...]] = (
        ExtraArg(
            "models",
            "mapping",
            "{}",
            "Model name -> the directory holding its tokenizer.json and "
            "tokenizer_config.json; other models' requests are scored from the "
            "approximate view.",
        ),
    )


class _MemoCollector(Collector):
    def __init__(self, tokenizers: Mapping[str, SegmentTokenizer]) -> None:
        self.tokenizers = tokenizers

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        family = CounterMetricFamily(
            "extproc_precise_prefix_segments",
            "Prompt segments tokenized (miss) or found in the memo (hit), per model.",
            labels=["model", "result"],
        )
        memo = GaugeMetricFamily(
            "extproc_precise_prefix_memo_tokens",
            "A model's segment memo: its tokens plus one per segment (what its share of "
            "memoTokens bounds).",
            labels=["model"],
        )
        for model, tok in self.tokenizers.items():
            family.add_metric([model, "hit"], tok.hits)
            family.add_metric([model, "miss"], tok.misses)
            memo.add_metric([model], tok.memo_size)
        return [family, memo]


def _memo_collector(registry: CollectorRegistry) -> _MemoCollector:
    collector = _MemoCollector({})
    registry.register(collector)
    return collector


# The arguments that shape the approximate view (the precise view is always kept).
APPROX_ARGS = ("blockSizeToHash", "maxBlocksToMatch", "maxHashCacheSize")


class PrecisePrefixCache:
    """Scores by the pods' reported KV cache; records prompts for the approximate view."""

    type_name: ClassVar[str] = "precise-prefix-cache"
    args_type: ClassVar[type[PreciseArgs]] = PreciseArgs

    def __init__(self, args: PreciseArgs, models: Mapping[str, str], ctx: PluginContext) -> None:
        self.args = args
        self.index = PreciseIndex(args.capacityBlocks, args.staleSeconds, args.provisionalSeconds)
        self.approx = PrefixIndex(args.maxHashCacheSize)
        self.models = dict(models)  # model -> tokenizer directory, for ``adopt``
        self.recorded = RecordTimes()  # the approximate view's, for ``pod_view``
        share = max(1, args.memoTokens // max(1, len(models)))
        try:
            self.tokenizers = {m: SegmentTokenizer(d, share) for m, d in models.items()}
        except ValueError as exc:
            raise ConfigError(f"precise-prefix-cache: {exc}") from None
        self.arrivals = Arrivals()
        # The pods' LoRA adapters: vLLM keys an adapter's blocks by its name too.
        self.adapters: frozenset[str] = frozenset()
        registry = ctx.registry
        ratio = shared_metric(  # shared: a reload builds the plugin again
            registry,
            Histogram,
            "extproc_precise_prefix_cache_match_ratio",
            "Fraction of the prompt's blocks the best pod holds, each time it scores.",
            ["model"],
            buckets=MATCH_RATIO_BUCKETS,
        )
        self._ratio = cache(ratio.labels)
        fallbacks = shared_metric(
            registry,
            Counter,
            "extproc_precise_prefix_fallbacks",
            "Scores taken from the approximate view: the request could not be tokenized "
            "exactly (not_exact, unknown_model), the tokenizing threads had no room for "
            "it (busy), or a pod's view was stale (stale_pod).",
            ["reason"],
        )
        self._fallbacks = cache(fallbacks.labels)
        tokenize = shared_metric(
            registry,
            Histogram,
            "extproc_precise_prefix_tokenize_seconds",
            "Time to render and tokenize one request (memo lookups included).",
            ["model"],
            buckets=TOKENIZE_BUCKETS,
        )
        self._tokenize_time = cache(tokenize.labels)
        self._evictions = shared_metric(
            registry,
            Counter,
            "extproc_precise_prefix_cache_evictions",
            "Approximate-view entries dropped because a pod's list was full.",
            ["model"],
        )
        entries = shared_metric(
            registry,
            Gauge,
            "extproc_precise_prefix_cache_entries",
            "Approximate-view entries stored across all pods.",
        )
        entries.set_function(lambda: self.approx.num_entries)
        shared_metric(
            registry,
            Gauge,
            "extproc_precise_prefix_arriving_requests",
            "Routed requests whose prompt counts as cached on their pick (not ended yet).",
        ).set_function(lambda: self.arrivals.num_requests)
        self._memo = per_registry(
            registry, "precise-prefix-memo", lambda: _memo_collector(registry)
        )
        self._memo.tokenizers = self.tokenizers

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> PrecisePrefixCache:
        raw = args if isinstance(args, dict) else {}
        models = raw.get("models") or {}
        if not isinstance(models, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in models.items()
        ):
            raise ConfigError(
                "precise-prefix-cache: 'models' must map model names to tokenizer directories"
            )
        numeric = {k: v for k, v in raw.items() if k != "models"}
        return cls(load_args(cls.args_type, numeric), models, ctx)

    def adopt(self, previous: object) -> bool:
        """``Reloadable``: the pods' KV-event view always (the events subscriber feeds
        that object; new ``capacityBlocks`` and ``staleSeconds`` apply to it from now on),
        the tokenizers' memo when ``models`` and ``memoTokens`` are unchanged, the
        approximate view and the provisional credit when their geometry is."""
        if not isinstance(previous, PrecisePrefixCache):
            return False
        old, new = previous.args, self.args
        self.index, self.adapters = previous.index, previous.adapters
        self.index.stale_s = new.staleSeconds
        self.index.provisional_s = new.provisionalSeconds  # for the next seeding
        if new.capacityBlocks != old.capacityBlocks:
            self.index.capacity = new.capacityBlocks  # new pods' views; and the known:
            for view in list(self.index.views.values()):
                view.capacity = new.capacityBlocks  # trimmed at their next stored event
        if previous.models == self.models and old.memoTokens == new.memoTokens:
            self.tokenizers = previous.tokenizers
            self._memo.tokenizers = self.tokenizers
        kept_approx = same_geometry(self.type_name, "approximate view", old, new, APPROX_ARGS)
        if kept_approx:
            self.approx, self.recorded = previous.approx, previous.recorded
        kept_credit = same_geometry(self.type_name, "provisional credit", old, new, ["blockSize"])
        if kept_credit:
            self.arrivals = previous.arrivals
        return kept_approx and kept_credit

    # Tokens and matches -----------------------------------------------------------

    def prompt_tokens(self, cycle: Cycle) -> TokenIds | None:
        """The request's exact token ids, or None when they cannot be had (counted);
        tokenized here unless ``prepare``'s work was done (or skipped) already."""
        if not cycle.tokenized:
            work = self.prepare(cycle)
            if work is not None:
                work.run()
        return cycle.token_ids

    def prepare(self, cycle: Cycle) -> Preparation | None:
        """``Preparer``: render and cut the prompt, and finish at once when the memo holds
        every segment; else the encoding of the missing ones is what is left to run."""
        if cycle.tokenized:
            return None
        req = cycle.request
        tok = self.tokenizers.get(req.model)
        if tok is None or req.data is None:
            self._fallback(cycle, "unknown_model" if tok is None else "not_exact")
            return None
        start = time.perf_counter()
        try:
            segments = tok.segments(req.api, req.data)
        except NotExact as exc:
            log.debug("precise-prefix-cache: approximate for this request: %s", exc)
            self._fallback(cycle, "not_exact")
            return None
        cut_s = time.perf_counter() - start
        if not segments.missing:
            self._encode(cycle, tok, segments, cut_s)
            return None
        return Preparation(
            run=lambda: self._encode(cycle, tok, segments, cut_s),
            skip=lambda: self._fallback(cycle, "busy"),
        )

    def _encode(
        self, cycle: Cycle, tok: SegmentTokenizer, segments: Segments, cut_s: float
    ) -> None:
        start = time.perf_counter()
        cycle.token_ids = tok.encode(segments)
        cycle.tokenized = True
        elapsed = cut_s + time.perf_counter() - start
        if not cycle.explaining:
            self._tokenize_time(cycle.request.model).observe(elapsed)

    def _fallback(self, cycle: Cycle, reason: str) -> None:
        cycle.tokenized = True  # token_ids stays None: scored from the approximate view
        if not cycle.explaining:
            self._fallbacks(reason).inc()

    def _credit_keys(self, cycle: Cycle, tokens: TokenIds) -> Keys:
        """The keys a pick is credited with: in ``blockSize`` blocks, whatever the pod's.
        The decision is made: the chains kept for it go (the cycle lives until the end)."""
        keys = as_keys(self._chain(cycle, tokens, self.args.blockSize))
        cycle.token_chains.clear()
        cycle.precise_matches = None
        return keys

    def _chain(self, cycle: Cycle, tokens: TokenIds, size: int) -> list[int]:
        """The token ids' block keys in ``size`` blocks, chained once per decision (the
        score, the exact counts and the credit read them); a LoRA adapter's request keyed
        by the adapter's name, as vLLM keys its blocks."""
        keys = cycle.token_chains.get(size)
        if keys is None:
            request = cycle.request
            lora = request.model if request.model in self.adapters else None
            keys = chain_keys(tokens, size, request.cache_salt, lora)
            cycle.token_chains[size] = keys
        return keys

    def _precise(self, cycle: Cycle, tokens: TokenIds, pods: Sequence[PodId]) -> PreciseMatches:
        """``PreciseMatches`` for ``pods``, matched once per decision: the score and the
        exact counts ask for the same candidates."""
        ids = tuple(pods)
        known = cycle.precise_matches
        if known is None or known.pods != ids:
            known = cycle.precise_matches = PreciseMatches(ids, *self._match(cycle, tokens, ids))
        return known

    def _match(
        self, cycle: Cycle, tokens: TokenIds, pods: Iterable[PodId]
    ) -> tuple[dict[PodId, tuple[int, int, int]], list[PodId]]:
        credit_size = self.args.blockSize
        credit: dict[PodId, int] = {}
        if len(self.arrivals) and (credit_keys := self._chain(cycle, tokens, credit_size)):
            credit = self.arrivals.match(as_keys(credit_keys))
        out: dict[PodId, tuple[int, int, int]] = {}
        stale: list[PodId] = []
        now = time.monotonic()
        views = self.index.views
        num_credit_blocks = -1  # the prompt's blocks in ``blockSize``, chained when needed
        for pod in pods:
            view = views.get(pod)
            if view is None:  # no events yet: nothing cached but what is arriving
                if num_credit_blocks < 0:
                    num_credit_blocks = len(self._chain(cycle, tokens, credit_size))
                out[pod] = (credit.get(pod, 0), 0, num_credit_blocks)
                continue
            if view.stale(now):
                stale.append(pod)
                continue
            size = self._block_size(view)
            keys = self._chain(cycle, tokens, size)
            gpu, offloaded = self.index.match(pod, keys)
            arriving = credit.get(pod, 0) * credit_size // size
            if arriving > gpu:  # the arriving blocks will be on the GPU
                gpu, offloaded = arriving, max(0, gpu + offloaded - arriving)
            out[pod] = (gpu, offloaded, len(keys))
        return out, stale

    def _block_size(self, view: PodView | None) -> int:
        """A pod's block size: its events' once they tell it, else ``blockSize``."""
        return (view.block_size if view is not None else None) or self.args.blockSize

    def _approx_fraction(self, cycle: Cycle, pods: Sequence[PodId]) -> dict[PodId, float]:
        if not pods:  # every pod's view is trusted: the usual case
            return {}
        keys = cycle.block_keys(self.args.blockSizeToHash, self.args.maxBlocksToMatch)
        if not len(keys):
            return {}
        matches = self.approx.match(keys, pods, len(pods))
        return {pod: matched / len(keys) for pod, matched in matches.items()}

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        return self._scores(cycle, [p.id for p in pods])

    def score_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Scores:
        """``score`` on ``table``'s rows, without building the pods' list and a dict."""
        ids = table.ids
        return per_row(table, positions, self._scores(cycle, [ids[i] for i in positions.tolist()]))

    def _scores(self, cycle: Cycle, ids: list[PodId]) -> dict[PodId, int]:
        tokens = self.prompt_tokens(cycle)
        fractions: dict[PodId, float] = {}
        approximate: list[PodId] = ids
        if tokens is not None:
            _, precise, approximate = self._precise(cycle, tokens, ids)
            if approximate and not cycle.explaining:
                self._fallbacks("stale_pod").inc(len(approximate))
            cpu = self.args.cpuWeight
            for pod, (gpu, offloaded, total) in precise.items():
                if total:
                    fractions[pod] = (gpu + cpu * offloaded) / total
        fractions.update(self._approx_fraction(cycle, approximate))
        best = sorted(fractions.items(), key=lambda kv: kv[1], reverse=True)
        best = [kv for kv in best[: self.args.topKMatches] if kv[1] > 0]
        if not cycle.explaining:
            self._ratio(cycle.request.model).observe(best[0][1] if best else 0.0)
        return {pod: int(fraction * 100) for pod, fraction in best}

    def exact_matches(self, cycle: Cycle, pods: Sequence[Pod]) -> ExactMatches | None:
        """``ExactPrefix``: prompt tokens each pod with a trusted view will find cached,
        as vLLM counts them (whole GPU blocks, at most the prompt's length less one)."""
        tokens = self.prompt_tokens(cycle)
        if tokens is None:
            return None
        exact, _ = self._exact_and_provisional(cycle, tokens, pods)
        return ExactMatches(len(tokens), exact)

    def _exact_and_provisional(
        self, cycle: Cycle, tokens: TokenIds, pods: Sequence[Pod]
    ) -> tuple[dict[PodId, int], dict[PodId, int]]:
        """Tokens each pod with a trusted view will find cached: those known exactly, and
        those whose match runs through seeded blocks not yet confirmed (provisional)."""
        precise = self._precise(cycle, tokens, [p.id for p in pods]).blocks
        limit = max(0, len(tokens) - 1)
        exact: dict[PodId, int] = {}
        provisional: dict[PodId, int] = {}
        views = self.index.views
        for pod, (gpu, _, _) in precise.items():
            if not gpu:
                exact[pod] = 0
                continue
            size = self._block_size(views.get(pod))
            tokens_cached = min(gpu, limit // size) * size
            if self.index.provisional_in(pod, self._chain(cycle, tokens, size), gpu):
                provisional[pod] = tokens_cached
            else:
                exact[pod] = tokens_cached
        return exact, provisional

    def matched_tokens(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        """``exact_matches``' counts, the provisional ones, and the approximate view's
        for the fallbacks."""
        tokens = self.prompt_tokens(cycle)
        out: dict[PodId, int] = {}
        num_tokens = cycle.num_prompt_tokens
        if tokens is not None:
            exact, provisional = self._exact_and_provisional(cycle, tokens, pods)
            out = exact | provisional
            num_tokens = len(tokens)
        approximate = [p.id for p in pods if p.id not in out]
        for pod, fraction in self._approx_fraction(cycle, approximate).items():
            out[pod] = int(fraction * num_tokens)
        return out

    def matched_bytes(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        """``PrefixMatcher`` for cost-aware: matched tokens in its bytes-per-token units."""
        limit = cycle.num_prompt_bytes
        return {
            pod: min(limit, n * BYTES_PER_TOKEN)
            for pod, n in self.matched_tokens(cycle, pods).items()
        }

    # Recorder and pods ------------------------------------------------------------

    def record(self, cycle: Cycle, pod: PodId) -> None:
        """The approximate view learns from served prompts, as prefix-cache's does."""
        keys = cycle.block_keys(self.args.blockSizeToHash, self.args.maxBlocksToMatch)
        if len(keys):
            evicted = self.approx.record(keys, pod)
            self.recorded.mark(pod)
            if evicted:
                self._evictions.labels(cycle.request.model).inc(evicted)

    def arriving(self, cycle: Cycle, pod: PodId) -> None:
        """``pod`` was picked for ``cycle``: its blocks count as held there until it ends
        (the keys another replica's pick carried, for a replayed cycle)."""
        keys = cycle.credit_keys
        if keys is None:
            tokens = self.prompt_tokens(cycle)
            if tokens is None:
                return
            keys = cycle.credit_keys = self._credit_keys(cycle, tokens)
        if len(keys):
            self.arrivals.add(keys, pod)

    def settled(self, cycle: Cycle, pod: PodId) -> None:
        """The request picked for ``pod`` ended (any outcome): its credit goes."""
        keys = cycle.credit_keys
        if keys is not None and len(keys):
            self.arrivals.remove(keys, pod)

    def pods_changed(self, pods: Sequence[Pod]) -> None:
        self.adapters = adapters_of(pods)
        self.approx.retain_pods(p.id for p in pods)
        self.arrivals.forget_pods({p.id for p in pods})
        self.recorded.retain({p.id for p in pods})

    def pod_view(self, pod: PodId) -> ViewState:
        """``ViewInspector``: the blocks ``pod``'s events say it holds (every medium),
        whether that view is distrusted now, and the approximate view's last record."""
        view = self.index.views.get(pod)
        if view is None:
            return ViewState(0, self.recorded.age(pod))
        blocks = sum(len(b) for b in list(view.blocks.values()))
        return ViewState(blocks, self.recorded.age(pod), view.stale())
