"""What the router tells its observers: each routing decision, and each request's end.

Observers (per-request metrics, traces, JSON pick logs, the status page's recent picks)
are told after the fact, on the thread that routed or completed the request, and must
be quick: they run on the request path. One that raises is logged and skipped; the
request is unaffected. With no observer the router builds neither record.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

from extproc.pods import Pod, PodId

log = logging.getLogger("extproc.routing")


class Routed(NamedTuple):
    """One routing decision, as it was made (tuples: built per request, cheaply)."""

    request_id: str | None
    model: str
    headers: Mapping[str, str]  # the request headers extproc was sent (trace context)
    arrived_unix_ns: int  # when extproc had the whole request (wall clock, for spans)
    arrived_s: float  # the same instant on ``time.perf_counter()``
    decided_s: float  # ``time.perf_counter()`` when the pods were picked
    queued_s: float  # held by flow control (0 when admitted at once)
    preparing_s: float  # waiting for and running the slow preparation (tokenizing)
    num_candidates: int  # pods the request could go to
    pods: tuple[Pod, ...]  # the pick, then the fallbacks
    prefill: Pod | None
    pinned: bool  # session sticky: sent to its bound pod without scoring
    prompt_tokens: int  # exact when ``exact``, else estimated from the prompt's bytes
    predicted_cached_tokens: int  # on the pick
    exact: bool  # the prompt was tokenized as the engine will (precise mode)


class EndTiming(NamedTuple):
    """What Envoy's access log says of a request's course (None: not in the entry)."""

    first_upstream_byte_s: float | None  # from the request's start to the first byte back
    duration_s: float | None  # to the last byte sent to the client
    request_bytes: int  # headers and body
    response_bytes: int
    response_code: int


class Ended(NamedTuple):
    """One request's end as Envoy reported it to this replica."""

    request_id: str
    model: str | None  # None: routed by nobody this replica heard of
    pod: PodId | None  # the pod that served the last attempt, if known
    succeeded: bool
    attempts: int
    timing: EndTiming | None
    # On ``pod``, for a request routed here (None for one routed elsewhere):
    prompt_tokens: int | None = None
    predicted_cached_tokens: int | None = None
    exact: bool = False


class RouteObserver(Protocol):
    def routed(self, routed: Routed) -> None: ...

    def ended(self, ended: Ended) -> None: ...


def tell_routed(observers: Sequence[RouteObserver], routed: Routed) -> None:
    for observer in observers:
        try:
            observer.routed(routed)
        except Exception:
            log.exception("route observer %s failed on a decision", type(observer).__name__)


def tell_ended(observers: Sequence[RouteObserver], ended: Ended) -> None:
    for observer in observers:
        try:
            observer.ended(ended)
        except Exception:
            log.exception("route observer %s failed on an end", type(observer).__name__)
