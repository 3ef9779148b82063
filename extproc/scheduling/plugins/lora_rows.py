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
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import numpy.typing as npt

from extproc.pods import LoraSlots
from extproc.scheduling.podtable import PodTable

ACTIVE, FREE, WAITING, FULL, UNKNOWN = range(5)
States = npt.NDArray[np.int64]  # one state code per row of a pod table

_ADAPTERS = "lora_rows: the snapshot's adapters"  # a pod table's scratch key


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
    adapters: frozenset[str] = table.memo(
        _ADAPTERS, lambda: frozenset().union(*map(attrgetter("adapters"), table.pods))
    )
    return model in adapters


def lora_states(table: PodTable, model: str) -> States | None:
    """Per row of ``table``, the state of adapter ``model``; None for a base model.
    Computed once per snapshot and model (the scraped slots change with each scrape)."""
    if not is_adapter(table, model):
        return None
    return table.memo(("lora_rows", model), lambda: _states(table, model))


def _states(table: PodTable, model: str) -> States:
    slots = (p.metrics.lora for p in table.pods)
    states = np.fromiter((state(s, model) for s in slots), np.int64, len(table))
    states.flags.writeable = False  # shared by the snapshot's requests
    return states


def queued_adapters(slots: LoraSlots | None) -> int:
    """Adapters queued on a pod for a slot (waiting, none of their requests running)."""
    return 0 if slots is None else len(slots.waiting - slots.running)
