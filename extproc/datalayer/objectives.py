"""Objective priorities from Kubernetes: the Gateway API Inference Extension's InferenceObjectives.

``InferenceObjectiveWatcher`` mirrors a namespace's ``InferenceObjective`` objects with
list + watch (``reflector``; watched, not polled) and publishes the whole map
``objective name -> priority`` through ``on_change`` after the first list and whenever
it changes. The flow control reads it to classify a request by its
``x-gateway-inference-objective`` header.

What counts (the v1alpha2 API, ``inference.networking.x-k8s.io``):

* ``metadata.name`` is the objective's name; ``spec.priority`` its priority, an integer
  (absent means 0, as the API says);
* with ``pool`` given, only objectives whose ``spec.poolRef.name`` (or one of the newer
  ``spec.poolRefs[*].name``) is that InferencePool; without it, every objective of the
  namespace;
* a malformed objective (no name, a priority that is not an integer, a ``poolRef``
  without a name, only a ``poolSelector``, which needs the pools' labels) is left out
  of the map with one warning naming it, until it is fixed or deleted.

Threads, errors and a missing CRD (an empty map until it appears) as in ``crd_watch``.

Least RBAC (in the Role of ``k8s``)::

    - apiGroups: [inference.networking.x-k8s.io]
      resources: [inferenceobjectives]
      verbs: [list, watch]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightkube.generic_resource import GenericNamespacedResource

from extproc.datalayer.crd_watch import INFERENCE_API, CustomResourceWatcher, MalformedObject

DEFAULT_OBJECTIVE_API = INFERENCE_API
KIND = "InferenceObjective"
PLURAL = "inferenceobjectives"
POOL_KIND = "InferencePool"


class MalformedObjective(MalformedObject):
    """An InferenceObjective extproc cannot read; the message says why."""


def objective_priority(obj: Mapping[str, Any], pool: str | None) -> int | None:
    """An InferenceObjective's priority, or None when it targets another pool.

    Raises:
        MalformedObjective: the message says what is wrong.
    """
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, Mapping) or not isinstance(metadata.get("name"), str):
        raise MalformedObjective("no metadata.name")
    spec = obj.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise MalformedObjective(f"spec must be an object, got {spec!r}")
    if pool is not None and pool not in _pool_names(spec):
        return None
    priority = spec.get("priority")
    if priority is None:
        return 0
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise MalformedObjective(f"spec.priority must be an integer, got {priority!r}")
    return priority


def _pool_names(spec: Mapping[str, Any]) -> set[str]:
    """The InferencePools ``spec.poolRef`` and ``spec.poolRefs`` name.

    Raises:
        MalformedObjective: a reference has no name, or the objective selects pools by label only.
    """
    refs = [spec["poolRef"]] if spec.get("poolRef") is not None else []
    more = spec.get("poolRefs") or []
    refs += more if isinstance(more, list) else [more]
    if not refs:
        if spec.get("poolSelector") is not None:
            raise MalformedObjective(
                "spec.poolSelector is not supported: name the pool in spec.poolRef"
            )
        raise MalformedObjective("no spec.poolRef")
    names = set()
    for ref in refs:
        if not isinstance(ref, Mapping) or not isinstance(ref.get("name"), str):
            raise MalformedObjective(f"a pool reference needs a name, got {ref!r}")
        if ref.get("kind") in (None, "", POOL_KIND):
            names.add(ref["name"])
    return names


class InferenceObjectiveWatcher(CustomResourceWatcher[int, Mapping[str, int]]):
    """Publishes ``{objective name: priority}`` from Kubernetes (see the module docstring);
    arguments as ``CustomResourceWatcher``'s (``namespace``: an InferenceObjective names a
    pool of its own namespace). The map handed on is a fresh dict each time."""

    kind = KIND
    plural = PLURAL

    def _value(self, obj: GenericNamespacedResource) -> int | None:
        return objective_priority(obj, self.pool)

    def _gather(self, values: Mapping[str, int]) -> Mapping[str, int]:
        return dict(values)
