"""cost-aware (Score, ours): favour the pod expected to return the first token soonest.

Not Kthena's plugin of the same name (a token-budget reservation scheme with other
arguments, whose keys this one ignores). Per candidate pod, the estimated time to first
token is its queued prefill work plus the prefill of the prompt tokens it does not hold:

    est_ms = prefillMsPerToken * (queued * mean_tokens + uncached_tokens)
           + decodeMsPerToken * (running + queued)

* ``uncached_tokens = ceil((prompt_bytes - held_bytes) / 4)``; ``held_bytes`` is the
  prefix the prefix-cache plugin matched for the pod (its ``PrefixMatcher``, handed over in
  ``PluginContext.prefix``; 0 without that plugin, and at most its hashed window, so
  the tail of a longer prompt counts as uncached).
* ``queued = waiting + unseen``: requests the pod has not started, where ``unseen =
  max(0, in_flight - waiting - running)`` are the router's requests the last scrape
  cannot show yet (as in least-request).
* ``mean_tokens``: the router's in-flight prefill tokens for the pod over its in-flight
  requests (each counted with its own uncached estimate, so queued hits on a warm
  prefix are cheap), or this prompt's tokens when none are in flight.
* ``decodeMsPerToken * (running + queued)``: every running or queued request adds one
  decoded token to each engine step, and the first token needs at least one step.

``score = floor(100 * (max_est - est) / (max_est - min_est))``: the cheapest candidate
100, the most expensive 0; all 100 when the estimates are equal.

Defaults: ``prefillMsPerToken`` and ``decodeMsPerToken`` model an 8B model on one
A100-class GPU (its prefill speed; how much longer a decode step gets for each sequence
it runs). Side output: ``cycle.uncached_tokens`` for every candidate, which the router
passes to ``InFlight.start`` for the pod it picks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from extproc.pods import Pod, PodId
from extproc.scheduling.args import arg, load_args
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import Cycle, PluginContext, PodTerms, PrefixMatcher
from extproc.scheduling.plugins.pod_work import pod_work, uncached_tokens, work_terms

log = logging.getLogger("extproc.scheduling")


@dataclass(frozen=True, slots=True)
class CostAwareArgs:
    prefillMsPerToken: float = arg(
        0.025,
        "Milliseconds of prefill per token: of the prompt's uncached tokens and of "
        "the prompts queued ahead on the pod.",
    )
    decodeMsPerToken: float = arg(
        0.2,
        "Milliseconds each running or queued request adds to the first token (one "
        "decoded token per engine step).",
    )


class CostAware:
    """Scores pods by estimated time to first token, queue and prefix cache included."""

    type_name: ClassVar[str] = "cost-aware"
    args_type: ClassVar[type[CostAwareArgs]] = CostAwareArgs

    def __init__(
        self, args: CostAwareArgs, in_flight: InFlight, prefix: PrefixMatcher | None
    ) -> None:
        self.args = args
        self.in_flight = in_flight
        self.prefix = prefix
        if prefix is None:
            log.info("cost-aware: no prefix-cache plugin configured; no pod holds a prefix")

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> CostAware:
        return cls(load_args(cls.args_type, args), ctx.in_flight, ctx.prefix)

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        estimates = self.estimate_ms(cycle, pods)
        lo, hi = min(estimates.values(), default=0.0), max(estimates.values(), default=0.0)
        if hi == lo:
            return dict.fromkeys(estimates, 100)
        return {pod_id: int(100 * (hi - est) / (hi - lo)) for pod_id, est in estimates.items()}

    def estimate_ms(self, cycle: Cycle, pods: Sequence[Pod]) -> dict[PodId, float]:
        """Each pod's estimated time to first token; records ``cycle.uncached_tokens``."""
        held = self._held_bytes(cycle, pods)
        prefill_ms, decode_ms = self.args.prefillMsPerToken, self.args.decodeMsPerToken
        estimates: dict[PodId, float] = {}
        for pod in pods:
            uncached = uncached_tokens(cycle, held.get(pod.id, 0))
            work = pod_work(cycle, pod, uncached, self.in_flight)
            estimates[pod.id] = prefill_ms * (
                work.queued * work.mean_tokens + work.uncached
            ) + decode_ms * (pod.metrics.running + work.queued)
        return estimates

    def explain(self, cycle: Cycle, pods: Sequence[Pod]) -> list[PodTerms]:
        """``Explainer``: each pod's terms of ``est_ms`` (module doc); changes nothing but
        ``cycle``'s side output (give it a cycle of its own)."""
        held = self._held_bytes(cycle, pods)
        prefill_ms, decode_ms = self.args.prefillMsPerToken, self.args.decodeMsPerToken
        out = []
        for pod in pods:
            uncached = uncached_tokens(cycle, held.get(pod.id, 0))
            work = pod_work(cycle, pod, uncached, self.in_flight)
            prefill = prefill_ms * (work.queued * work.mean_tokens + work.uncached)
            decode = decode_ms * (pod.metrics.running + work.queued)
            terms = work_terms(pod, work, cycle.num_prompt_tokens, self.in_flight)
            terms |= {"prefill_ms": prefill, "decode_ms": decode, "est_ms": prefill + decode}
            out.append(PodTerms(pod.id, terms))
        return out

    def _held_bytes(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        if self.prefix is None:
            return {}
        return self.prefix.matched_bytes(cycle, pods)
