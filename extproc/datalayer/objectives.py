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

Threads and errors as in ``k8s.KubePodSource``: ``start()`` lists synchronously
(retrying up to ``start_timeout_s``, then ``ConfigError``), the watch then runs in a
daemon thread with its own asyncio loop until ``stop()``, and later failures are logged
and retried. One exception: when the API server does not serve the resource (404: the
CRD is not installed), ``start()`` publishes an empty map, logs one warning and returns;
the watcher lists again every ``backoff_max_s`` and follows the objectives once the CRD
appears.

Least RBAC (in the Role of ``k8s``)::

    - apiGroups: [inference.networking.x-k8s.io]
      resources: [inferenceobjectives]
      verbs: [list, watch]
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightkube import AsyncClient
from lightkube.config.kubeconfig import SingleConfig
from lightkube.generic_resource import GenericNamespacedResource, create_namespaced_resource

from extproc.datalayer.k8s import WatchThread, WatchTiming
from extproc.datalayer.reflector import KubeApiError, Reflector
from extproc.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_OBJECTIVE_API = "inference.networking.x-k8s.io/v1alpha2"
KIND = "InferenceObjective"
PLURAL = "inferenceobjectives"
POOL_KIND = "InferencePool"
NOT_SERVED = 404  # the API server has no such resource: the CRD is not installed


class MalformedObjective(ValueError):
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


@dataclass(frozen=True, slots=True)
class _Entry:
    """One mirrored object: its priority (None: not counted) and what is wrong with it."""

    priority: int | None
    problem: str | None = None


class InferenceObjectiveWatcher(WatchThread):
    """Publishes ``{objective name: priority}`` from Kubernetes (see the module docstring).

    Args:
        config: the API server and credentials (``kubeconfig.load_kube_config``).
        on_change: called with the whole map after the first list and whenever it
            changes (from the watch thread; the map is a fresh dict each time).
        namespace: where the objectives are (an InferenceObjective names a pool of its
            own namespace).
        pool: count only the objectives of this InferencePool; None: all in the namespace.
        api: the objectives' ``group/version``.
        timing: timeouts and backoff (default ``WatchTiming()``).
    """

    def __init__(
        self,
        config: SingleConfig,
        on_change: Callable[[Mapping[str, int]], object],
        *,
        namespace: str,
        pool: str | None = None,
        api: str = DEFAULT_OBJECTIVE_API,
        timing: WatchTiming | None = None,
    ) -> None:
        group, _, version = api.rpartition("/")
        if not group or not version:
            raise ConfigError(f"the InferenceObjective API must be group/version, got {api!r}")
        self.config = config
        self.namespace = namespace
        self.pool = pool
        self.api = api
        self.timing = timing or WatchTiming()
        self.name = f"InferenceObjectives in {namespace}" + (f" of pool {pool}" if pool else "")
        self.priorities: Mapping[str, int] = {}
        self._resource = create_namespaced_resource(
            group, version, KIND, PLURAL, verbs=["list", "watch"]
        )
        self._on_change = on_change
        self._published = False
        self._problems: set[tuple[str, str]] = set()
        self._last_error: KubeApiError | None = None
        self._objectives: Reflector[GenericNamespacedResource, _Entry] | None = None
        self._thread_name = f"k8s-watch:{self.namespace}/{PLURAL}"

    async def _follow(self) -> None:
        reflector = self._objectives
        assert reflector is not None  # set by _initial_sync
        if reflector.resource_version is None:
            await self._wait_until_served(reflector)
        await reflector.run()

    async def _initial_sync(self, api: AsyncClient) -> None:
        """List, retrying until the caller's timeout; a missing CRD publishes no objectives."""
        reflector = self._objectives = self._reflector(api)
        backoff = self._backoff()
        while True:
            try:
                await reflector.list()
                return
            except KubeApiError as exc:
                if exc.status == NOT_SERVED:
                    log.warning(
                        "%s: the API server does not serve %s (%s); no objectives until it "
                        "does, checking every %g s",
                        self.name,
                        f"{PLURAL}.{self.api}",
                        exc,
                        self.timing.backoff_max_s,
                    )
                    self._publish(reflector)
                    return
                self._last_error = exc
                delay_s = backoff.next_delay_s()
                log.warning("%s: %s; retrying in %.1f s", self.name, exc, delay_s)
                await asyncio.sleep(delay_s)

    async def _wait_until_served(
        self, reflector: Reflector[GenericNamespacedResource, _Entry]
    ) -> None:
        """List every ``backoff_max_s`` until the CRD exists: quietly while it answers 404."""
        while True:
            await asyncio.sleep(self.timing.backoff_max_s)
            try:
                await reflector.list()
                log.info("%s: the API server now serves %s", self.name, PLURAL)
                return
            except KubeApiError as exc:
                if exc.status != NOT_SERVED:
                    log.warning("%s: %s", self.name, exc)

    def _reflector(self, api: AsyncClient) -> Reflector[GenericNamespacedResource, _Entry]:
        reflector: Reflector[GenericNamespacedResource, _Entry] = Reflector(
            api,
            self._resource,
            namespace=self.namespace,
            convert=self._convert,
            on_change=lambda: self._publish(reflector),
            what=self.name,
            backoff=self._backoff(),
            watch_timeout_s=self.timing.watch_timeout_s,
        )
        return reflector

    def _convert(self, obj: GenericNamespacedResource) -> _Entry:
        try:
            return _Entry(objective_priority(obj, self.pool))
        except MalformedObjective as exc:
            return _Entry(None, str(exc))

    def _publish(self, reflector: Reflector[GenericNamespacedResource, _Entry]) -> None:
        """Warn once per new problem; hand on the map when it changed (or never was)."""
        entries = reflector.items
        problems = {(name, e.problem) for name, e in entries.items() if e.problem is not None}
        for name, problem in sorted(problems - self._problems):
            log.warning("%s %s/%s: %s; ignored", KIND, self.namespace, name or "(no name)", problem)
        self._problems = problems
        priorities = {n: e.priority for n, e in entries.items() if e.priority is not None}
        if self._published and priorities == self.priorities:
            return
        log.info("%s: %d objectives", self.name, len(priorities))
        self._on_change(dict(priorities))
        self.priorities = priorities  # after on_change: if it raised, the next change publishes
        self._published = True
