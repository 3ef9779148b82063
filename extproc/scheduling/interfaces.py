"""The scheduler's vocabulary: a scheduling ``Cycle`` and the plugin interfaces.

Plugins are small classes registered by name (``registry.BUILTIN``); one instance per
configured name serves every role it has (a plugin may be both a Filter and a Scorer).

* ``Filter``: pods -> fewer pods.
* ``Scorer``: pods -> a score 0..100 each; the scheduler adds ``weight * score``.
* ``Recorder``: learns from a response that ended successfully (``record``).
* ``PodsListener``: told when the set of known pods changes (e.g. to drop state).
* ``BlockRecorder``: a Recorder that learns only the prompt's block keys of one geometry,
  so its records can travel to other replicas as those keys (``routing.records``).
* ``Provisional``: credits a pick at once (``arriving``) and drops the credit when the
  request ends, however it ends (``settled``); what it learns for good is ``record``'s.
* ``Preparer``: has slow work to do on a cycle before scoring it (tokenizing a prompt);
  says so cheaply (``prepare`` -> a ``Preparation``), so the router can run it off the
  thread that serves the other requests, or do without it when its pool is full.
* ``ExactPrefix``: knows, for a request it can tokenize, the prompt's exact token count
  and the tokens each pod will find cached (precise-prefix-cache, from the pods' KV
  events), or says where it cannot.

Filters and scorers may also work on a whole snapshot at once (``TableFilter``,
``TableScorer``: NumPy columns of a ``PodTable`` instead of ``Pod`` objects); the scheduler
uses those when a plugin has them, so a request's cost hardly grows with the pods.

Plugins get what they share when they are built, in ``PluginContext``: the router's
``InFlight`` counters, the configured ``PrefixMatcher`` (the prefix-cache plugin, built
first, which ``cost-aware`` reads) and the configured ``ExactPrefix`` (built before it,
which ``estimated-ttft`` reads). The prefix-cache metrics are shared per registry
(``plugins.prefix_metrics.prefix_cache_metrics``), not through the context.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry

from extproc.kernels import pure as pure_kernels
from extproc.pods import Pod, PodId
from extproc.prefix.hashing import Keys, prompt_keys
from extproc.request.parse import Api, InferenceRequest
from extproc.request.tokens import TokenIds
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.podtable import PodTable, Positions, RowValues

if TYPE_CHECKING:
    from extproc.scheduling.plugins.precise_prefix_cache import PreciseMatches
    from extproc.scheduling.plugins.session_book import Found, SessionPrompt

Scores = npt.NDArray[np.int64]  # one score per row of the ``Positions`` scored

BYTES_PER_TOKEN = pure_kernels.BYTES_PER_TOKEN  # defined with the kernels, which use it too


@dataclass(slots=True)
class Cycle:
    """One request's pass through the scheduler; plugins share work through it."""

    request: InferenceRequest
    # Prompt tokens each scored pod would prefill (prompt minus the prefix it holds),
    # left by the cost plugins: per pod (``score``), or per candidate row of a table pass
    # (``score_table``); see ``num_prefill_tokens``.
    uncached_tokens: dict[PodId, int] = field(default_factory=dict)
    # The prompt's exact token ids, once a plugin tokenized it (precise-prefix-cache,
    # maybe on another thread: ``Preparer``); ``tokenized`` tells that it was tried, as
    # ``token_ids`` stays None for a request that cannot be tokenized exactly. An array,
    # not a list: the cycle lives until the request ends, and a list costs twice the memory.
    token_ids: TokenIds | None = None
    tokenized: bool = False
    # The keys a ``Provisional`` plugin credited the pick with, in its own blocks (precise-
    # prefix-cache's, from the token ids), kept to take the credit back at the end; they
    # travel with the pick to other replicas (``routing.records.Started``).
    credit_keys: Keys | None = None
    uncached_rows: list[RowValues] = field(default_factory=list)
    # The token ids' chained block keys per block size (precise-prefix-cache's), kept
    # while the request is decided: its score, exact counts and credit read them.
    token_chains: dict[int, list[int]] = field(default_factory=dict)
    # precise-prefix-cache's matches for the candidates, kept while the request is
    # decided: its score and the exact counts read them.
    precise_matches: PreciseMatches | None = None
    # An explanation's cycle (``Scheduler.explain``): plugins observe no metric for it.
    explaining: bool = False
    # The session estimated-ttft's book found while scoring, for placing the pick
    # without searching again (``SessionBook.lookup``).
    session_found: Found | None = None
    # What estimated-ttft's book reads of the request, made once (scoring and the pick
    # both read it).
    session_prompt: SessionPrompt | None = None
    # The pod estimated-ttft's hold ranked first where its estimate ranked another, if
    # any (``extproc_sessions_held_total`` when picked).
    session_held: PodId | None = None
    _keys: dict[tuple[int, int], Keys] = field(default_factory=dict)
    _num_prompt_bytes: int = -1

    @property
    def num_prompt_bytes(self) -> int:
        """The rendered prompt's length in UTF-8 bytes, computed once."""
        if self._num_prompt_bytes < 0:
            prompt = self.request.prompt
            self._num_prompt_bytes = len(prompt) if prompt.isascii() else len(prompt.encode())
        return self._num_prompt_bytes

    @property
    def num_prompt_tokens(self) -> int:
        """Estimated prompt tokens: ceil(bytes / ``BYTES_PER_TOKEN``)."""
        return -(-self.num_prompt_bytes // BYTES_PER_TOKEN)

    def num_prefill_tokens(self, pod: PodId) -> int:
        """Tokens ``pod`` would prefill for this prompt, for ``InFlight.start``.

        A cost plugin's estimate when it scored ``pod`` (per pod, else the latest table
        pass's), else the whole prompt.
        """
        found = self.uncached_tokens.get(pod)
        if found is not None:
            return found
        for rows in reversed(self.uncached_rows):
            found = rows.get(pod)
            if found is not None:
                return found
        return self.num_prompt_tokens

    @property
    def num_engine_prompt_tokens(self) -> int:
        """The prompt's tokens as the engine counts them when it was tokenized exactly
        (``token_ids``), else the estimate (``num_prompt_tokens``)."""
        ids = self.token_ids
        return len(ids) if ids is not None else self.num_prompt_tokens

    def predicted_cached_tokens(self, pod: PodId) -> int:
        """Prompt tokens the scheduler expects ``pod`` to find cached: the prompt less
        what ``num_prefill_tokens`` says it would prefill (0 where no cost plugin scored
        ``pod``)."""
        return max(0, self.num_engine_prompt_tokens - self.num_prefill_tokens(pod))

    @classmethod
    def replayed(
        cls,
        model: str,
        session_key: str | None,
        keys: Mapping[tuple[int, int], Keys],
        credit_keys: Keys | None = None,
    ) -> Cycle:
        """A cycle rebuilt from a record made elsewhere (another replica, or Envoy's
        access log): only what ``BlockRecorder``s read, its model, session and block keys,
        and for a pick its credit keys; the prompt itself did not travel (nothing to
        tokenize)."""
        request = InferenceRequest(Api.COMPLETIONS, model, "", session_key=session_key)
        return cls(request, tokenized=True, credit_keys=credit_keys, _keys=dict(keys))

    def block_keys(self, block_size: int, max_blocks: int) -> Keys:
        """The prompt's chained block hashes (``prefix.hashing``), as the int64 array
        ``PrefixIndex`` takes, looked up once per block geometry."""
        key = (block_size, max_blocks)
        keys = self._keys.get(key)
        if keys is None:
            req = self.request
            keys = prompt_keys(req.model, req.prompt, block_size, max_blocks, req.cache_salt)
            self._keys[key] = keys
        return keys


@runtime_checkable
class PrefixMatcher(Protocol):
    def matched_bytes(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        """Bytes of the prompt's start each pod is believed to hold; pods left out: 0."""
        ...


class ExactMatches(NamedTuple):
    """A request's prompt as the engine counts it, and what pods hold of it."""

    num_prompt_tokens: int
    # Per pod whose view is exact: prompt tokens the engine will find cached (provisional
    # credit included). A pod left out has no exact view (its events were lost).
    matched_tokens: Mapping[PodId, int]


@runtime_checkable
class ExactPrefix(Protocol):
    def exact_matches(self, cycle: Cycle, pods: Sequence[Pod]) -> ExactMatches | None:
        """Exact counts for ``cycle`` on ``pods``; None when the request cannot be
        tokenized as the engine will (then no pod's count is exact)."""
        ...


@dataclass(frozen=True, slots=True)
class PluginContext:
    """What a plugin may use when it is built: where to register its metrics, the
    router's in-flight counters, and the prefix view and the exact prefix counts, if
    configured plugins offer them (plugins that offer them are built before the others)."""

    registry: CollectorRegistry
    in_flight: InFlight = field(default_factory=InFlight)
    prefix: PrefixMatcher | None = None
    exact: ExactPrefix | None = None


class Plugin(Protocol):
    type_name: ClassVar[str]

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> Plugin: ...


@runtime_checkable
class Filter(Protocol):
    type_name: ClassVar[str]

    def filter(self, cycle: Cycle, pods: Sequence[Pod]) -> Sequence[Pod]: ...


@runtime_checkable
class Scorer(Protocol):
    type_name: ClassVar[str]

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        """0..100 per pod; pods left out score 0."""
        ...


@runtime_checkable
class TableFilter(Protocol):
    def filter_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Positions:
        """The rows of ``positions`` that pass, in the same order; same rule as ``filter``."""
        ...


@runtime_checkable
class TableScorer(Protocol):
    def score_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Scores:
        """0..100 per row of ``positions`` (ascending), equal to ``score`` on those pods."""
        ...


@runtime_checkable
class Recorder(Protocol):
    def record(self, cycle: Cycle, pod: PodId) -> None:
        """Called once, after ``pod`` served the request's response to its end."""
        ...


@runtime_checkable
class BlockRecorder(Protocol):
    @property
    def block_geometry(self) -> tuple[int, int]:
        """(block size, max blocks): the one ``Cycle.block_keys`` its ``record`` reads."""
        ...


@runtime_checkable
class Provisional(Protocol):
    def arriving(self, cycle: Cycle, pod: PodId) -> None:
        """``pod`` was picked for ``cycle``; its response has not ended yet."""
        ...

    def settled(self, cycle: Cycle, pod: PodId) -> None:
        """The request picked for ``pod`` ended (success, failure, retry, timeout)."""
        ...


@dataclass(frozen=True, slots=True)
class Preparation:
    """Slow work a cycle needs before it is scored; exactly one of the two is called."""

    run: Callable[[], None]  # do it (on any thread)
    skip: Callable[[], None]  # no room to do it now: score the cycle without it (counted)


@runtime_checkable
class Preparer(Protocol):
    def prepare(self, cycle: Cycle) -> Preparation | None:
        """Quick: what is left to do for ``cycle`` before scoring, if it is slow; None
        when nothing slow is (what was quick to do is done)."""
        ...


@runtime_checkable
class PodsListener(Protocol):
    def pods_changed(self, pods: Sequence[Pod]) -> None:
        """The known pods are now exactly ``pods``."""
        ...


class RecordTimes:
    """When each pod's view last learned a record (monotonic), for ``ViewInspector``:
    one dict store per record, which the admin port reads as an age."""

    __slots__ = ("_at",)

    def __init__(self) -> None:
        self._at: dict[PodId, float] = {}

    def mark(self, pod: PodId) -> None:
        self._at[pod] = time.monotonic()

    def age(self, pod: PodId) -> float | None:
        at = self._at.get(pod)
        return None if at is None else time.monotonic() - at

    def retain(self, keep: Container[PodId]) -> None:
        self._at = {pod: at for pod, at in self._at.items() if pod in keep}


class ViewState(NamedTuple):
    """What a plugin's prefix view holds for one pod (``/debug/pods``)."""

    blocks: int  # entries (blocks) the view holds for the pod
    last_record_age_s: float | None  # since the pod's last record here; None: never
    stale: bool = False  # the view is distrusted now (precise-prefix-cache after lost events)


@runtime_checkable
class ViewInspector(Protocol):
    """A plugin keeping a per-pod prefix view, read by the admin port (read-only, any
    thread; never on the request path)."""

    type_name: ClassVar[str]

    def pod_view(self, pod: PodId) -> ViewState: ...


class PodTerms(NamedTuple):
    """One pod's terms in a cost plugin's estimate (``explain``): the names and values of
    its formula's terms, for a person to read."""

    pod: PodId
    terms: Mapping[str, float]


@runtime_checkable
class Explainer(Protocol):
    """A scorer that can show its per-pod terms without changing any state (``/debug/
    pick``): no metric observed, nothing recorded or credited."""

    type_name: ClassVar[str]

    def explain(self, cycle: Cycle, pods: Sequence[Pod]) -> list[PodTerms]: ...


@runtime_checkable
class Reloadable(Protocol):
    """A plugin whose state a configuration reload keeps (``admin.reload``): the plugin
    built from the new configuration takes over its predecessor's (same type) views,
    pending credit and counters, each where its geometry is unchanged."""

    def adopt(self, previous: object) -> bool:
        """Take over ``previous``'s state where compatible; False when some of it was
        dropped (the plugin logs which view and why) or ``previous`` is not of its type."""
        ...
