"""Model rewrites from Kubernetes: the Gateway API Inference Extension's InferenceModelRewrites.

``ModelRewriteWatcher`` mirrors a namespace's ``InferenceModelRewrite`` objects with list
+ watch (``reflector``, as ``objectives`` does for InferenceObjectives) and publishes
them through ``on_change`` after the first list and whenever they change, as
``WatchedRewrite`` (the object's name and its ``spec.rules`` as written, parsed by the
routing layer: ``routing.rewrites.WatchedRules``), oldest object first (then by name):
the Inference Extension's precedence (the older object's rule for a model wins).

What counts (``inference.networking.x-k8s.io``, ``DEFAULT_REWRITE_API``):

* with ``pool`` given, only objects whose ``spec.poolRef.name`` is that InferencePool;
* an object without a name or a ``poolRef`` is left out with one warning naming it,
  until it is fixed or deleted.

Threads, errors and a missing CRD as in ``objectives``. Least RBAC::

    - apiGroups: [inference.networking.x-k8s.io]
      resources: [inferencemodelrewrites]
      verbs: [list, watch]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from lightkube import AsyncClient
from lightkube.config.kubeconfig import SingleConfig
from lightkube.generic_resource import GenericNamespacedResource, create_namespaced_resource

from extproc.datalayer.k8s import WatchThread, WatchTiming
from extproc.datalayer.kubeconfig import load_kube_config
from extproc.datalayer.reflector import KubeApiError, Reflector
from extproc.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_REWRITE_API = "inference.networking.x-k8s.io/v1alpha2"
KIND = "InferenceModelRewrite"
PLURAL = "inferencemodelrewrites"
NOT_SERVED = 404  # the CRD is not installed


class MalformedRewrite(ValueError):
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


@dataclass(frozen=True, slots=True)
class _Entry:
    """One mirrored object: its order key, its rules (None: not counted), its problem."""

    order: tuple[str, str]  # (creationTimestamp, name): oldest first
    rules: Any
    problem: str | None = None


class ModelRewriteWatcher(WatchThread):
    """Publishes the InferenceModelRewrites (module docstring).

    Args:
        config: the API server and credentials.
        on_change: called with the objects' rules, oldest object first, after the first
            list and whenever they change (from the watch thread).
        namespace: where the objects are.
        pool: only the objects of this InferencePool; None: all in the namespace.
        api: the objects' ``group/version``.
        timing: timeouts and backoff.
    """

    def __init__(
        self,
        config: SingleConfig,
        on_change: Callable[[Published], object],
        *,
        namespace: str,
        pool: str | None = None,
        api: str = DEFAULT_REWRITE_API,
        timing: WatchTiming | None = None,
    ) -> None:
        group, _, version = api.rpartition("/")
        if not group or not version:
            raise ConfigError(f"the {KIND} API must be group/version, got {api!r}")
        self.config = config
        self.namespace = namespace
        self.pool = pool
        self.timing = timing or WatchTiming()
        self.name = f"{KIND}s in {namespace}" + (f" of pool {pool}" if pool else "")
        self.published: Published = ()
        self._resource = create_namespaced_resource(
            group, version, KIND, PLURAL, verbs=["list", "watch"]
        )
        self._what = f"{PLURAL}.{api}"
        self._on_change = on_change
        self._published = False
        self._problems: set[tuple[str, str]] = set()
        self._reflector: Reflector[GenericNamespacedResource, _Entry] | None = None
        self._thread_name = f"k8s-watch:{namespace}/{PLURAL}"

    async def _initial_sync(self, api: AsyncClient) -> None:
        """List, retrying until the caller's timeout; a missing CRD publishes no rules."""
        reflector = self._reflector = Reflector(
            api,
            self._resource,
            namespace=self.namespace,
            convert=self._convert,
            on_change=self._publish,
            what=self.name,
            backoff=self._backoff(),
            watch_timeout_s=self.timing.watch_timeout_s,
        )
        backoff = self._backoff()
        while True:
            try:
                await reflector.list()
                return
            except KubeApiError as exc:
                if exc.status == NOT_SERVED:
                    log.warning("%s: %s is not served (%s)", self.name, self._what, exc)
                    self._publish()
                    return
                self._last_error = exc
                delay_s = backoff.next_delay_s()
                log.warning("%s: %s; retrying in %.1f s", self.name, exc, delay_s)
                await asyncio.sleep(delay_s)

    async def _follow(self) -> None:
        reflector = self._reflector
        assert reflector is not None  # set by _initial_sync
        while reflector.resource_version is None:  # the CRD was missing: list again, quietly
            await asyncio.sleep(self.timing.backoff_max_s)
            try:
                await reflector.list()
            except KubeApiError as exc:
                if exc.status != NOT_SERVED:
                    log.warning("%s: %s", self.name, exc)
        await reflector.run()

    def _convert(self, obj: GenericNamespacedResource) -> _Entry:
        metadata = obj.get("metadata") or {}
        order = (str(metadata.get("creationTimestamp") or ""), str(metadata.get("name") or ""))
        try:
            return _Entry(order, rewrite_rules(obj, self.pool))
        except MalformedRewrite as exc:
            return _Entry(order, None, str(exc))

    def _publish(self) -> None:
        """Warn once per new problem; hand on the rules when they changed (or never were)."""
        assert self._reflector is not None
        entries = self._reflector.items
        problems = {(name, e.problem) for name, e in entries.items() if e.problem is not None}
        for name, problem in sorted(problems - self._problems):
            log.warning("%s %s/%s: %s; ignored", KIND, self.namespace, name or "(no name)", problem)
        self._problems = problems
        counted = sorted((e for e in entries.values() if e.rules is not None), key=_order)
        published = tuple(
            WatchedRewrite(f"{KIND} {self.namespace}/{e.order[1]}", e.rules) for e in counted
        )
        if self._published and published == self.published:
            return
        log.info("%s: %d objects", self.name, len(published))
        self._on_change(published)
        self.published = published  # after on_change: if it raised, the next change publishes
        self._published = True


def _order(entry: _Entry) -> tuple[str, str]:
    return entry.order


def make_rewrites_watcher(
    args: argparse.Namespace, on_change: Callable[[Published], object]
) -> ModelRewriteWatcher | None:
    """With an InferencePool, the watcher of its InferenceModelRewrites (not started);
    None otherwise (the chart grants their RBAC only with a pool)."""
    if not args.inference_pool:
        return None
    config = load_kube_config(args.kubeconfig, args.kube_context)
    return ModelRewriteWatcher(
        config,
        on_change,
        namespace=args.k8s_namespace or config.namespace,
        pool=args.inference_pool,
        timing=WatchTiming(start_timeout_s=args.k8s_start_timeout_s),
    )
