"""lora-affinity (Filter, Score): keep the pods serving the requested model, and favour
those where its LoRA adapter is active, then those with a free adapter slot (Kthena's
filter; the Gateway API Inference Extension's scorer).

* Filter (Kthena's ``lora_affinity.go``): keeps the pods whose model set (base models and
  adapters, ``Pod.models``) contains the request's ``model``, exactly: an empty name
  keeps only pods listing an empty name.
* Score, from vLLM's ``vllm:lora_requests_info`` (``PodMetrics.lora``), in the order of
  the Inference Extension's LoRA-affinity scorer (1.0 / 0.8 / 0.6 / 0.0 there, 0..100
  here): the adapter active on the pod (requests running with it) 100; a free slot
  (adapters running or waiting fewer than ``max_lora``) 80; every slot taken and the
  adapter queued there 60; every slot taken by other adapters 0
  (``scheduling.plugins.lora_rows``).
* Every pod scores the same when there is nothing to tell them apart: a request for a
  base model (a model no pod lists among its ``adapters``) scores 100 everywhere, so the
  plugin changes no base-model decision; a pod whose page has no LoRA metric scores 80
  for an adapter, as one with a free slot (a pod listing the adapter can load it).

No arguments. The adapters this replica routed to each pod lately count as active there
(``lora_rows.RoutedAdapters``): vLLM's metric names only those with requests in flight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from extproc.pods import Pod, PodId
from extproc.scheduling.interfaces import Cycle, PluginContext, Scores
from extproc.scheduling.plugins.lora_rows import (
    ACTIVE,
    FREE,
    FULL,
    UNKNOWN,
    WAITING,
    RoutedAdapters,
    lora_states,
)
from extproc.scheduling.podtable import PodTable, Positions

BASE_MODEL_SCORE = 100  # nothing to load: every pod alike
SCORE_BY_STATE = np.zeros(5, dtype=np.int64)  # indexed by ``lora_rows`` state code
SCORE_BY_STATE[[ACTIVE, FREE, WAITING, FULL, UNKNOWN]] = [100, 80, 60, 0, 80]
SCORE_BY_STATE.flags.writeable = False


class LoraAffinity:
    """Kthena's model-set filter and the Inference Extension's adapter-slot scorer."""

    type_name: ClassVar[str] = "lora-affinity"
    args_type: ClassVar[None] = None  # no arguments

    def __init__(self) -> None:
        self.routed = RoutedAdapters()

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> LoraAffinity:
        return cls()

    def adopt(self, previous: object) -> bool:
        """``Reloadable``: the adapters routed lately are kept."""
        if isinstance(previous, LoraAffinity):
            self.routed = previous.routed
        return True

    def arriving(self, cycle: Cycle, pod: PodId) -> None:
        self.routed.arriving(cycle.request.model, pod)

    def settled(self, cycle: Cycle, pod: PodId) -> None:
        """Nothing to take back: the adapter stays in its slot after the request."""

    def pods_changed(self, pods: Sequence[Pod]) -> None:
        self.routed.pods_changed(pods)

    def filter(self, cycle: Cycle, pods: Sequence[Pod]) -> Sequence[Pod]:
        model = cycle.request.model
        return [p for p in pods if model in p.models]

    def filter_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Positions:
        return positions[table.serves(cycle.request.model)[positions]]

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        table = PodTable(pods)
        scores = self.score_table(cycle, table, table.all_positions())
        return dict(zip(table.ids, scores.tolist(), strict=True))

    def score_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Scores:
        states = lora_states(table, cycle.request.model, self.routed)
        if states is None:
            return np.full(len(positions), BASE_MODEL_SCORE, dtype=np.int64)
        scores: Scores = SCORE_BY_STATE[states[positions]]
        return scores
