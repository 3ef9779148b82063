"""The status page's memory of routing: the last picks and each pod's predicted hits.

``RecentPicks`` is a ``RouteObserver`` (``routing.observe``) on ``Router.observers``. On
the request path it only appends: a decision to a bounded deque, an end to a bounded
map from request id to how it ended (twice the picks: ends of requests other replicas
routed come here too), and, for a request routed here that succeeded, its
prompt tokens and the cached tokens the scheduler predicted to the serving pod's totals
(the rule of ``extproc_routed_prompt_tokens_total`` and
``extproc_predicted_cached_tokens_total``, kept here per pod so the page needs no
registry lookups). The page reads copies, under the same short lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

from extproc.pods import PodId
from extproc.routing.observe import Ended, Routed

DEFAULT_SIZE = 50


@dataclass(frozen=True, slots=True)
class Pick:
    """One decision, as the page shows it."""

    at_unix_s: float  # when extproc had the whole request
    request_id: str | None
    model: str
    pods: tuple[PodId, ...]  # the pick, then the fallbacks
    prompt_tokens: int
    predicted_cached_tokens: int  # on the pick
    exact: bool  # precise mode: tokenized as the engine will
    queued_s: float  # held by flow control
    preparing_s: float  # tokenizing


@dataclass(frozen=True, slots=True)
class PickEnd:
    """How a picked request ended, from Envoy's access log."""

    served_by: PodId | None
    succeeded: bool
    attempts: int
    duration_s: float | None


@dataclass(frozen=True, slots=True)
class Predicted:
    """Tokens of the requests a pod served successfully, routed by this replica."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # predicted by the scheduler on that pod

    @property
    def ratio(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


class RecentPicks:
    """The last ``size`` decisions and their ends; per pod, the predicted cached tokens."""

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        if size < 1:
            raise ValueError(f"size must be 1 or more, got {size}")
        self.size = size
        self._lock = threading.Lock()
        self._picks: deque[Pick] = deque(maxlen=size)
        self._ends: OrderedDict[str, PickEnd] = OrderedDict()
        self._predicted: dict[PodId, Predicted] = {}

    def routed(self, routed: Routed) -> None:
        pick = Pick(
            at_unix_s=routed.arrived_unix_ns / 1e9,
            request_id=routed.request_id,
            model=routed.model,
            pods=tuple(p.id for p in routed.pods),
            prompt_tokens=routed.prompt_tokens,
            predicted_cached_tokens=routed.predicted_cached_tokens,
            exact=routed.exact,
            queued_s=routed.queued_s,
            preparing_s=routed.preparing_s,
        )
        with self._lock:
            self._picks.append(pick)

    def ended(self, ended: Ended) -> None:
        duration_s = ended.timing.duration_s if ended.timing is not None else None
        end = PickEnd(ended.pod, ended.succeeded, ended.attempts, duration_s)
        with self._lock:
            self._ends[ended.request_id] = end
            if len(self._ends) > 2 * self.size:  # room for ends of requests routed elsewhere
                self._ends.popitem(last=False)
            if ended.succeeded and ended.pod is not None and ended.prompt_tokens is not None:
                was = self._predicted.get(ended.pod, Predicted())
                self._predicted[ended.pod] = Predicted(
                    was.prompt_tokens + ended.prompt_tokens,
                    was.cached_tokens + (ended.predicted_cached_tokens or 0),
                )

    def recent(self) -> list[tuple[Pick, PickEnd | None]]:
        """The picks, newest first, each with its end if Envoy reported it yet."""
        with self._lock:
            picks, ends = list(self._picks), dict(self._ends)
        return [(p, ends.get(p.request_id) if p.request_id else None) for p in reversed(picks)]

    def predicted(self) -> dict[PodId, Predicted]:
        """Per pod, since this replica started."""
        with self._lock:
            return dict(self._predicted)
