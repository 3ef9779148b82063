"""What a pod has to do before a new prompt's first token: the arithmetic the cost
plugins share (``cost-aware``, ``estimated-ttft``)."""

from __future__ import annotations

from typing import NamedTuple

from extproc.pods import Pod
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import BYTES_PER_TOKEN, Cycle


class PodWork(NamedTuple):
    uncached: int  # prompt tokens the pod would prefill: the prompt less what it holds
    queued: int  # requests it has not started: waiting, and routed ones no scrape shows yet
    mean_tokens: float  # prefill tokens of each queued request


def uncached_tokens(cycle: Cycle, held_bytes: int) -> int:
    """Prompt tokens a pod holding ``held_bytes`` of the prompt's start would prefill,
    estimated from bytes: ``ceil((prompt bytes - held bytes) / BYTES_PER_TOKEN)``."""
    return -(-(cycle.num_prompt_bytes - held_bytes) // BYTES_PER_TOKEN)


def pod_work(
    cycle: Cycle,
    pod: Pod,
    uncached: int,
    in_flight: InFlight,
    num_prompt_tokens: int | None = None,
) -> PodWork:
    """The pod's work ahead of ``cycle``'s prompt, of which it would prefill ``uncached``
    tokens; records ``cycle.uncached_tokens``.

    ``queued = waiting + max(0, in_flight - waiting - running)`` (as least-request);
    ``mean_tokens``: the router's in-flight prefill tokens over its in-flight requests
    (each counted with its own uncached count, so queued hits on a warm prefix are
    cheap), or this prompt's tokens (``num_prompt_tokens``, by default the cycle's
    estimate) when none are in flight.
    """
    cycle.uncached_tokens[pod.id] = uncached
    waiting, running = pod.metrics.waiting, pod.metrics.running
    num_in_flight, in_flight_tokens = in_flight.get_count(pod.id)
    queued = waiting + max(0, num_in_flight - waiting - running)
    if num_in_flight:
        mean_tokens = in_flight_tokens / num_in_flight
    else:
        mean_tokens = cycle.num_prompt_tokens if num_prompt_tokens is None else num_prompt_tokens
    return PodWork(uncached, queued, mean_tokens)


def work_terms(
    pod: Pod, work: PodWork, num_prompt_tokens: int, in_flight: InFlight
) -> dict[str, float]:
    """The terms both cost plugins explain a pod's estimate by (``Explainer``): the
    prompt, what the pod holds of it, its load and the work ahead; each plugin adds its
    own times."""
    requests, tokens = in_flight.get_count(pod.id)
    return {
        "prompt_tokens": num_prompt_tokens,
        "cached_tokens": max(0, num_prompt_tokens - work.uncached),
        "uncached_tokens": work.uncached,
        "waiting": pod.metrics.waiting,
        "running": pod.metrics.running,
        "in_flight": requests,
        "in_flight_tokens": tokens,
        "queued": work.queued,
        "mean_queued_tokens": work.mean_tokens,
    }
