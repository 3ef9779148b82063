"""Where a request's LoRA adapter stands on each pod of a snapshot, as one state code per
row: what lora-affinity scores and estimated-ttft prices.

The states, from vLLM's ``vllm:lora_requests_info`` (``PodMetrics.lora``), in the order
the Gateway API Inference Extension's LoRA-affinity scorer ranks them:

* ``ACTIVE``: the adapter has requests running on the pod (its weights are in a slot);
* ``FREE``: it is not running there and a slot is free (adapters running or waiting
  fewer than ``max_lora``), so it can be loaded at once (waiting there or not);
* ``WAITING``: every slot is taken and the adapter is queued there already: it is loaded
  at the next slot to free;
* ``FULL``: every slot is taken by other adapters and it is not queued there;
* ``UNKNOWN``: the pod's page has no LoRA metric.

A request for a base model (in no pod's ``adapters``) has no states (``lora_states``
gives None): nothing to load anywhere.

vLLM's metric names only the adapters with requests in flight, while an adapter stays in
its slot after its requests end, until another needs the slot; and a scrape comes after
the picks it reflects. So the adapters this replica routed to a pod lately
(``RoutedAdapters``) count as active there too: the last ``max_lora`` of them, as the
engine's least-recently-used slots would hold them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from extproc.pods import LoraSlots, Pod, PodId, adapters_of
from extproc.scheduling.podtable import PodTable

ACTIVE, FREE, WAITING, FULL, UNKNOWN = range(5)
States = npt.NDArray[np.int64]  # one state code per row of a pod table

_ADAPTERS = "lora_rows: the snapshot's adapters"  # a pod table's scratch key
MAX_REMEMBERED = 16  # adapters remembered per pod, more than a pod's slots
ASSUMED_SLOTS = 1  # vLLM's default --max-loras, for a pod whose page has no LoRA metric yet


class RoutedAdapters:
    """The adapters this replica routed to each pod lately, the most recent last."""

    def __init__(self) -> None:
        self._recent: dict[PodId, dict[str, None]] = {}
        self._adapters: frozenset[str] = frozenset()  # the pods' adapters

    def arriving(self, model: str, pod: PodId) -> None:
        """A request for ``model`` was routed to ``pod`` (a base model's: nothing)."""
        if model not in self._adapters:
            return
        recent = self._recent.setdefault(pod, {})
        recent.pop(model, None)
        recent[model] = None
        if len(recent) > MAX_REMEMBERED:
            del recent[next(iter(recent))]

    def pods_changed(self, pods: Iterable[Pod]) -> None:
        pods = list(pods)
        self._adapters = adapters_of(pods)
        kept = {p.id for p in pods}
        for pod in [p for p in self._recent if p not in kept]:
            del self._recent[pod]

    def slots(self, pod: Pod) -> LoraSlots | None:
        """The pod's scraped slots, the last ``max_lora`` adapters routed to it counted
        running (module doc); a pod without the metric but with adapters routed to it is
        taken to have vLLM's default slots."""
        scraped = pod.metrics.lora
        recent = self._recent.get(pod.id)
        if not recent:
            return scraped
        slots = scraped if scraped is not None else LoraSlots(max_lora=ASSUMED_SLOTS)
        last = list(recent)[-slots.max_lora :] if slots.max_lora > 0 else []
        return replace(slots, running=slots.running | frozenset(last))


def state(slots: LoraSlots | None, adapter: str) -> int:
    """``adapter``'s state on a pod reporting ``slots`` (module doc)."""
    if slots is None:
        return UNKNOWN
    if adapter in slots.running:
        return ACTIVE
    if slots.has_free_slot():
        return FREE
    return WAITING if adapter in slots.waiting else FULL


def is_adapter(table: PodTable, model: str) -> bool:
    """Whether ``model`` is a LoRA adapter on some pod of the snapshot."""
    adapters: frozenset[str] = table.memo(_ADAPTERS, lambda: adapters_of(table.pods))
    return model in adapters


def lora_states(table: PodTable, model: str, routed: RoutedAdapters) -> States | None:
    """Per row of ``table``, the state of adapter ``model``; None for a base model."""
    if not is_adapter(table, model):
        return None
    return slots_per_row(table, routed, lambda slots: state(slots, model), np.int64)


def slots_per_row(
    table: PodTable,
    routed: RoutedAdapters,
    value: Callable[[LoraSlots | None], float],
    dtype: type[np.generic],
) -> npt.NDArray[Any]:
    """``value`` of each row's slots (``RoutedAdapters.slots``): a Python step a pod, paid
    by an adapter's requests only (a base model's have no states)."""
    return np.fromiter((value(routed.slots(p)) for p in table.pods), dtype, len(table))


def queued_adapters(slots: LoraSlots | None) -> int:
    """Adapters queued on a pod for a slot (waiting, none of their requests running)."""
    return 0 if slots is None else len(slots.waiting - slots.running)
