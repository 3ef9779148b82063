"""Model rewrites from Kubernetes: the Gateway API Inference Extension's InferenceModelRewrites.

``ModelRewriteWatcher`` mirrors a namespace's ``InferenceModelRewrite`` objects with list
+ watch (``crd_watch``, as ``objectives`` does for InferenceObjectives) and publishes
them through ``on_change`` after the first list and whenever they change, as
``WatchedRewrite`` (the object's name and its ``spec.rules`` as written, parsed by the
routing layer: ``routing.rewrites.WatchedRules``), oldest object first (then by name):
the Inference Extension's precedence (the older object's rule for a model wins).

What counts (``inference.networking.x-k8s.io``, ``crd_watch.INFERENCE_API``):

* with ``pool`` given, only objects whose ``spec.poolRef.name`` is that InferencePool;
* an object without a name or a ``poolRef`` is left out with one warning naming it,
  until it is fixed or deleted.

Threads, errors and a missing CRD (no rules until it appears) as in ``crd_watch``. Least RBAC::

    - apiGroups: [inference.networking.x-k8s.io]
      resources: [inferencemodelrewrites]
      verbs: [list, watch]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from lightkube.generic_resource import GenericNamespacedResource

from extproc.datalayer.crd_watch import CustomResourceWatcher, MalformedObject

KIND = "InferenceModelRewrite"
PLURAL = "inferencemodelrewrites"


class MalformedRewrite(MalformedObject):
    """An InferenceModelRewrite extproc cannot read; the message says why."""


class WatchedRewrite(NamedTuple):
    """One object's rules as written, and where they are (``Kind namespace/name``)."""

    where: str
    rules: Any


Published = tuple[WatchedRewrite, ...]


def rewrite_rules(obj: Mapping[str, Any], pool: str | None) -> Any:
    """An InferenceModelRewrite's ``spec.rules`` as written, or None when it belongs to
    another pool.

    Raises:
        MalformedRewrite: the message says what is wrong.
    """
    metadata = obj.get("metadata") or {}
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str):
        raise MalformedRewrite("no metadata.name")
    spec = obj.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise MalformedRewrite(f"spec must be an object, got {spec!r}")
    ref = spec.get("poolRef")
    if not isinstance(ref, Mapping) or not isinstance(ref.get("name"), str):
        raise MalformedRewrite(f"spec.poolRef needs a name, got {ref!r}")
    if pool is not None and ref["name"] != pool:
        return None
    return spec.get("rules") or []


class ModelRewriteWatcher(CustomResourceWatcher[tuple[str, Any], Published]):
    """Publishes the InferenceModelRewrites, oldest object first (module docstring);
    arguments as ``CustomResourceWatcher``'s."""

    kind = KIND
    plural = PLURAL

    def _value(self, obj: GenericNamespacedResource) -> tuple[str, Any] | None:
        """(creationTimestamp, the rules), or None for another pool's object."""
        rules = rewrite_rules(obj, self.pool)
        if rules is None:
            return None
        return str(obj["metadata"].get("creationTimestamp") or ""), rules

    def _gather(self, values: Mapping[str, tuple[str, Any]]) -> Published:
        oldest_first = sorted(values.items(), key=lambda item: (item[1][0], item[0]))
        return tuple(WatchedRewrite(self._where(name), rules) for name, (_, rules) in oldest_first)


def make_rewrites_watcher(
    args: argparse.Namespace, on_change: Callable[[Published], object]
) -> ModelRewriteWatcher | None:
    """With an InferencePool, the watcher of its InferenceModelRewrites (not started);
    None otherwise."""
    return ModelRewriteWatcher.of_pool(args, on_change)
