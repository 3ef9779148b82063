"""``--log-picks``: a log line per routing decision and per end, on logger
``extproc.picks`` (INFO), for ``--log-format json`` to carry as fields.

Decision: ``x_request_id``, ``model``, ``pick`` (address), ``pod`` (namespace/name),
``fallbacks`` (addresses), ``prefill``, ``pinned``, ``candidates``, ``prompt_tokens``,
``predicted_cached_tokens``, ``exact``, ``queued_s``, ``preparing_s``. End:
``x_request_id``, ``model``, ``served_by``, ``succeeded``, ``attempts``,
``response_code``, ``first_byte_s``, ``duration_s``. Off by default: a line per request
costs more CPU than the rest of the per-request observability together.
"""

from __future__ import annotations

import logging

from extproc.pods import PodId
from extproc.routing.observe import Ended, Routed

log = logging.getLogger("extproc.picks")


def _pod_name(pod: PodId | None) -> str | None:
    return None if pod is None else f"{pod.namespace}/{pod.name}"


class PickLog:
    """A route observer (``routing.observe``) logging each decision and end."""

    __slots__ = ()

    def routed(self, routed: Routed) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        pick = routed.pods[0] if routed.pods else None
        address = pick.address if pick is not None else None
        log.info(
            "pick %s %s -> %s",
            routed.request_id,
            routed.model,
            address,
            extra={
                "x_request_id": routed.request_id,
                "model": routed.model,
                "pick": address,
                "pod": _pod_name(pick.id if pick is not None else None),
                "fallbacks": [p.address for p in routed.pods[1:]],
                "prefill": routed.prefill.address if routed.prefill is not None else None,
                "pinned": routed.pinned,
                "candidates": routed.num_candidates,
                "prompt_tokens": routed.prompt_tokens,
                "predicted_cached_tokens": routed.predicted_cached_tokens,
                "exact": routed.exact,
                "queued_s": round(routed.queued_s, 6),
                "preparing_s": round(routed.preparing_s, 6),
            },
        )

    def ended(self, ended: Ended) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        timing = ended.timing
        served_by = _pod_name(ended.pod)
        log.info(
            "end %s %s by %s: %s",
            ended.request_id,
            ended.model,
            served_by,
            "succeeded" if ended.succeeded else "failed",
            extra={
                "x_request_id": ended.request_id,
                "model": ended.model,
                "served_by": served_by,
                "succeeded": ended.succeeded,
                "attempts": ended.attempts,
                "response_code": timing.response_code if timing is not None else None,
                "first_byte_s": timing.first_upstream_byte_s if timing is not None else None,
                "duration_s": timing.duration_s if timing is not None else None,
            },
        )
