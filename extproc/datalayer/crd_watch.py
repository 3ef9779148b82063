"""A watcher of one namespaced custom resource (a CRD's objects), published as a whole.

``CustomResourceWatcher`` mirrors a namespace's objects of one kind with list + watch
(``reflector``; watched, not polled), reads each into a value (``_value``: None when it
does not count here, ``MalformedObject`` when it cannot be read) and publishes all the
values, gathered by ``_gather``, through ``on_change`` after the first list and whenever
they change. A malformed object is left out with one warning naming it, until it is fixed
or deleted. Subclasses: ``objectives`` (InferenceObjectives), ``model_rewrites``
(InferenceModelRewrites).

Threads and errors as in ``k8s.KubePodSource``: ``start()`` lists synchronously
(retrying up to ``start_timeout_s``, then ``ConfigError``), the watch then runs in a
daemon thread with its own asyncio loop until ``stop()``, and later failures are logged
and retried. One exception: when the API server does not serve the resource (404: the
CRD is not installed), ``start()`` publishes nothing counted, logs one warning and
returns; the watcher lists again every ``backoff_max_s`` and follows the objects once
the CRD appears.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass
from typing import ClassVar, Generic, Self, TypeVar

from lightkube import AsyncClient
from lightkube.config.kubeconfig import SingleConfig
from lightkube.generic_resource import GenericNamespacedResource, create_namespaced_resource

from extproc.datalayer.k8s import WatchThread, WatchTiming
from extproc.datalayer.kubeconfig import load_kube_config
from extproc.datalayer.reflector import KubeApiError, Reflector
from extproc.errors import ConfigError

log = logging.getLogger(__name__)

INFERENCE_API = "inference.networking.x-k8s.io/v1alpha2"  # the Inference Extension's CRDs
NOT_SERVED = 404  # the API server has no such resource: the CRD is not installed

V = TypeVar("V")  # one object's value
P = TypeVar("P", bound=Sized)  # what is published: its len() is logged


class MalformedObject(ValueError):
    """An object extproc cannot read; the message says why."""


@dataclass(frozen=True, slots=True)
class _Entry(Generic[V]):
    """One mirrored object: its value (None: not counted) and what is wrong with it."""

    value: V | None
    problem: str | None = None


class CustomResourceWatcher(WatchThread, Generic[V, P]):
    """Publishes the values of a namespace's objects of one kind (module docstring).

    Subclasses set ``kind``, ``plural`` and ``default_api`` and write ``_value`` and
    ``_gather``; ``published`` is the last value handed to ``on_change``.

    Args:
        config: the API server and credentials (``kubeconfig.load_kube_config``).
        on_change: called with ``_gather``'s value after the first list and whenever it
            changes (from the watch thread).
        namespace: where the objects are.
        pool: count only the objects of this InferencePool; None: all in the namespace.
        api: the objects' ``group/version``; None: ``default_api``.
        timing: timeouts and backoff (default ``WatchTiming()``).
    """

    kind: ClassVar[str]
    plural: ClassVar[str]
    default_api: ClassVar[str] = INFERENCE_API

    def __init__(
        self,
        config: SingleConfig,
        on_change: Callable[[P], object],
        *,
        namespace: str,
        pool: str | None = None,
        api: str | None = None,
        timing: WatchTiming | None = None,
    ) -> None:
        self.api = self.default_api if api is None else api
        group, _, version = self.api.rpartition("/")
        if not group or not version:
            raise ConfigError(f"the {self.kind} API must be group/version, got {self.api!r}")
        self.config = config
        self.namespace = namespace
        self.pool = pool
        self.timing = timing or WatchTiming()
        self.name = f"{self.kind}s in {namespace}" + (f" of pool {pool}" if pool else "")
        self.published: P = self._gather({})
        self._resource = create_namespaced_resource(
            group, version, self.kind, self.plural, verbs=["list", "watch"]
        )
        self._on_change = on_change
        self._has_published = False
        self._problems: set[tuple[str, str]] = set()
        self._reflector: Reflector[GenericNamespacedResource, _Entry[V]] | None = None
        self._thread_name = f"k8s-watch:{namespace}/{self.plural}"

    @classmethod
    def of_pool(
        cls, args: argparse.Namespace, on_change: Callable[[P], object], api: str | None = None
    ) -> Self | None:
        """With ``--inference-pool``, the watcher of the pool's objects (not started);
        None otherwise (the chart grants their RBAC only with a pool)."""
        if not args.inference_pool:
            return None
        config = load_kube_config(args.kubeconfig, args.kube_context)
        return cls(
            config,
            on_change,
            namespace=args.k8s_namespace or config.namespace,
            pool=args.inference_pool,
            api=api,
            timing=WatchTiming(start_timeout_s=args.k8s_start_timeout_s),
        )

    def _value(self, obj: GenericNamespacedResource) -> V | None:
        """The object's value, or None when it does not count here (another pool's).

        Raises:
            MalformedObject: the message says what is wrong.
        """
        raise NotImplementedError

    def _gather(self, values: Mapping[str, V]) -> P:
        """What is published for the counted objects' values (by object name)."""
        raise NotImplementedError

    async def _initial_sync(self, api: AsyncClient) -> None:
        """List, retrying until the caller's timeout; a missing CRD publishes nothing counted."""
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
                    log.warning(
                        "%s: the API server does not serve %s.%s (%s); none until it does, "
                        "checking every %g s",
                        self.name,
                        self.plural,
                        self.api,
                        exc,
                        self.timing.backoff_max_s,
                    )
                    self._publish()
                    return
                self._last_error = exc
                delay_s = backoff.next_delay_s()
                log.warning("%s: %s; retrying in %.1f s", self.name, exc, delay_s)
                await asyncio.sleep(delay_s)

    async def _follow(self) -> None:
        reflector = self._reflector
        assert reflector is not None  # set by _initial_sync
        if reflector.resource_version is None:
            await self._wait_until_served(reflector)
        await reflector.run()

    async def _wait_until_served(
        self, reflector: Reflector[GenericNamespacedResource, _Entry[V]]
    ) -> None:
        """List every ``backoff_max_s`` until the CRD exists: quietly while it answers 404."""
        while True:
            await asyncio.sleep(self.timing.backoff_max_s)
            try:
                await reflector.list()
                log.info("%s: the API server now serves %s", self.name, self.plural)
                return
            except KubeApiError as exc:
                if exc.status != NOT_SERVED:
                    log.warning("%s: %s", self.name, exc)

    def _convert(self, obj: GenericNamespacedResource) -> _Entry[V]:
        try:
            return _Entry(self._value(obj))
        except MalformedObject as exc:
            return _Entry(None, str(exc))

    def _publish(self) -> None:
        """Warn once per new problem; hand on the values when they changed (or never were)."""
        assert self._reflector is not None  # set by _initial_sync
        entries = self._reflector.items
        problems = {(name, e.problem) for name, e in entries.items() if e.problem is not None}
        for name, problem in sorted(problems - self._problems):
            log.warning("%s: %s; ignored", self._where(name or "(no name)"), problem)
        self._problems = problems
        published = self._gather(
            {name: e.value for name, e in entries.items() if e.value is not None}
        )
        if self._has_published and published == self.published:
            return
        log.info("%s: %d counted", self.name, len(published))
        self._on_change(published)
        self.published = published  # after on_change: if it raised, the next change publishes
        self._has_published = True

    def _where(self, name: str) -> str:
        """An object in logs and messages: ``Kind namespace/name``."""
        return f"{self.kind} {self.namespace}/{name}"
