"""least-request (Filter, Score): keep pods with room in their queue, favour idle ones.

Kthena's least-request plugin, plus the router's own in-flight requests:

* Filter: removes pods whose scraped waiting queue reached ``maxWaitingRequests``
  (``waiting >= maxWaitingRequests``; default 10).
* Score: ``load = running + unseen + 100 * waiting``, where ``unseen = max(0, in_flight
  - waiting - running)`` counts the requests this router sent that the last scrape
  cannot show yet (a burst routed between two scrapes), as running ones (whether they
  will queue is not known yet). Waiting requests weigh 100, as in Kthena, so that any
  queue ranks a pod below every pod without one.
  ``score = floor(100 * (max_load - load) / max_load)`` over the candidates; when every
  load is 0 all score 100 (equal non-zero loads all score 0, as in Kthena: either way a
  constant, so neutral).

Inputs: ``Pod.metrics.waiting`` and ``.running`` (scraped), ``InFlight`` (the router).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from extproc.scheduling.args import load_args
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.podtable import PodTable, Positions
from extproc.scheduling.types import Cycle, PluginContext, Scores
from extproc.types import Pod, PodId

WAITING_WEIGHT = 100


@dataclass(frozen=True, slots=True)
class LeastRequestArgs:
    maxWaitingRequests: int = 10


class LeastRequest:
    """Filters out pods with a full queue and scores the least loaded highest."""

    type_name: ClassVar[str] = "least-request"

    def __init__(self, args: LeastRequestArgs, in_flight: InFlight) -> None:
        self.args = args
        self.in_flight = in_flight

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> LeastRequest:
        return cls(load_args(LeastRequestArgs, args), ctx.in_flight)

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
        waiting, running = table.waiting[positions], table.running[positions]
        in_flight = self.in_flight.requests_at(table.position, len(table))[positions]
        unseen = np.maximum(0, in_flight - waiting - running)
        loads = running + unseen + WAITING_WEIGHT * waiting
        max_load = int(loads.max()) if len(loads) else 0
        if max_load == 0:
            return np.full(len(positions), 100, dtype=np.int64)
        scores: Scores = 100 * (max_load - loads) // max_load
        return scores

    def load(self, pod: Pod) -> int:
        """``running + unseen + 100 * waiting`` (see the module docstring)."""
        waiting, running = pod.metrics.waiting, pod.metrics.running
        unseen = max(0, self.in_flight.get(pod.id) - waiting - running)
        return running + unseen + WAITING_WEIGHT * waiting
