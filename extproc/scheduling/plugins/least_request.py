"""least-request (Filter, Score): keep pods with room in their queue, favour idle ones.

Kthena's least-request plugin (``least_request.go``, the on-flight formula of May 2026):

* Filter: removes pods whose scraped waiting queue reached ``maxWaitingRequests``
  (``waiting >= maxWaitingRequests``; default 10).
* Score: ``base = on_flight + 100 * max(on_flight - running, 0)``, where ``on_flight``
  is the requests this router has sent the pod that have not ended (``InFlight``, the
  counterpart of Kthena's per-pod on-flight counter) and ``running`` the pod's scraped
  running requests: the router's requests the engine is not running yet are taken to
  be queued and weigh 100 each. ``score = int((max_base - base) / max_base * 100)`` in
  float64 over the candidates, as Go computes it; when every base is 0 all score 100.

Inputs: ``Pod.metrics.running`` (scraped; ``waiting`` for the filter), ``InFlight``.
Kthena syncs its counters across router replicas through Redis; extproc's count only
its own requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from extproc.pods import Pod, PodId
from extproc.scheduling.args import arg, load_args
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import Cycle, PluginContext, Scores
from extproc.scheduling.podtable import PodTable, Positions

QUEUED_WEIGHT = 100


@dataclass(frozen=True, slots=True)
class LeastRequestArgs:
    maxWaitingRequests: int = arg(
        10, "The filter removes the pods whose scraped waiting queue has this many requests."
    )
    UNPARSEABLE: ClassVar[str] = "Unmarshal LeastRequestArgs error, setting default value"


class LeastRequest:
    """Filters out pods with a full queue and scores the least loaded highest."""

    type_name: ClassVar[str] = "least-request"
    args_type: ClassVar[type[LeastRequestArgs]] = LeastRequestArgs

    def __init__(self, args: LeastRequestArgs, in_flight: InFlight) -> None:
        self.args = args
        self.in_flight = in_flight

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> LeastRequest:
        return cls(load_args(cls.args_type, args), ctx.in_flight)

    def filter(self, cycle: Cycle, pods: Sequence[Pod]) -> Sequence[Pod]:
        limit = self.args.maxWaitingRequests
        return [p for p in pods if p.metrics.waiting < limit]

    def filter_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Positions:
        return positions[table.waiting[positions] < self.args.maxWaitingRequests]

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        table = PodTable(pods)
        scores = self.score_table(cycle, table, table.all_positions())
        return dict(zip(table.ids, scores.tolist(), strict=True))

    def score_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Scores:
        on_flight = self.in_flight.requests_at(table.position, len(table))[positions]
        queued = np.maximum(on_flight - table.running[positions], 0)
        bases = (on_flight + QUEUED_WEIGHT * queued).astype(np.float64)
        max_base = float(bases.max()) if len(bases) else 0.0
        if max_base <= 0:
            return np.full(len(positions), 100, dtype=np.int64)
        # Go: int(((maxScore - base) / maxScore) * 100), float64, truncated
        scores: Scores = ((max_base - bases) / max_base * 100).astype(np.int64)
        return scores
