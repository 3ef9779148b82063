"""Pods from Kubernetes: a namespace's pods by label selector, or an InferencePool's.

``KubePodSource`` mirrors the selected pods with list + watch (``reflector``), turns each
into its endpoints (``k8s_objects``: one ``Pod`` a target port, address ``podIP:port``,
models and adapters from annotations or a label, role label, readiness) and publishes the whole ``tuple[Pod, ...]`` through
``on_change`` whenever it changes, like ``PodsFileWatcher``. A deleted pod leaves the
tuple (so the prefix index purges it); an unready or terminating pod stays with
``ready=False``.

Two modes:

* selector: ``target=PodTarget("app=vllm", (8000,))`` watches the pods of namespace NS
  matching ``app=vllm`` (``parse_selector``), sending to port 8000;
* pool: ``pool="NAME"`` watches the InferencePool ``NS/NAME``
  (``/apis/inference.networking.k8s.io/v1/...``, or ``pool_api`` such as
  ``inference.networking.x-k8s.io/v1alpha2``) and watches the pods its
  ``spec.selector`` selects, on each of its target ports (data-parallel ranks: every
  port an endpoint of its own, ``<pod>-rank-N`` when there are several); the pool is a
  lightkube generic resource. When the selector or ports change the pod watch restarts
  with them (the previous pods stay published until the new list
  arrives); an invalid edit keeps the previous target; a missing or deleted pool
  publishes no pods until it exists again.

A GIE pool serves one base model but does not name it, so in pool mode pods still take
their models from the annotation/label, and ``--k8s-default-model`` names the pool's
model for pods that carry neither; a pod with no model is listed but gets no requests
(logged once), since the scheduler sends a request only to pods serving its model.

The lightkube client (``kubeconfig.make_client``) lives in the watch thread's loop.
``start()`` lists synchronously (retrying for up to ``start_timeout_s``), so the first
``on_change`` has happened when it returns, and raises ``ConfigError`` naming the API
server if that fails; the watch then runs in a daemon thread with its own asyncio loop
until ``stop()``. Failures after start are logged and retried with backoff, never raised.

Least RBAC (a Role in the watched namespace, bound to extproc's service account)::

    rules:
      - apiGroups: [""]
        resources: [pods]
        verbs: [list, watch]
      # only with --inference-pool; the group is the pool API's
      # (inference.networking.x-k8s.io for v1alpha2):
      - apiGroups: [inference.networking.k8s.io]
        resources: [inferencepools]
        verbs: [list, watch]
        resourceNames: [NAME]  # allowed: the watch sets fieldSelector=metadata.name=NAME

No ``get``, no cluster-wide rights, nothing written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightkube import AsyncClient
from lightkube.config.kubeconfig import SingleConfig
from lightkube.generic_resource import GenericNamespacedResource, create_namespaced_resource
from lightkube.resources.core_v1 import Pod as K8sPod

from extproc.datalayer.k8s_objects import (
    PodMapping,
    PodTarget,
    make_pods,
    make_snapshot,
    parse_pool,
    parse_selector,
    pod_warnings,
)
from extproc.datalayer.kubeconfig import describe, make_client
from extproc.datalayer.reflector import DEFAULT_WATCH_TIMEOUT_S, Backoff, KubeApiError, Reflector
from extproc.errors import ConfigError
from extproc.pods import Pod, PodId

log = logging.getLogger(__name__)

DEFAULT_POOL_API = "inference.networking.k8s.io/v1"


@dataclass(frozen=True, slots=True)
class WatchTiming:
    """Timeouts and retry delays (tests shrink them)."""

    start_timeout_s: float = 10.0  # start(): the initial list must succeed within this
    request_timeout_s: float = 10.0  # one list page
    watch_timeout_s: float = DEFAULT_WATCH_TIMEOUT_S  # the server ends a watch after this
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0


class WatchThread:
    """A list + watch run on its own daemon thread and asyncio loop (lightkube's client
    is async): ``start`` returns once the first list is in (or failed), ``stop`` cancels
    it. Subclasses set ``name``, ``config``, ``timing`` and ``_thread_name`` and write
    ``_initial_sync`` and ``_follow``."""

    name: str
    config: SingleConfig
    timing: WatchTiming
    _thread_name: str
    _last_error: KubeApiError | None = None
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _main_task: asyncio.Task[None] | None = None
    _stopping = False

    def start(self) -> None:
        """List, publish, then watch in a daemon thread until ``stop()``.

        Raises:
            ConfigError: the first list did not succeed within ``start_timeout_s``.
        """
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._run(started)),
            name=self._thread_name,
            daemon=True,
        )
        self._thread.start()
        try:
            started.result(timeout=self.timing.start_timeout_s + 5.0)
        except TimeoutError:  # the thread hung: _main bounds the list by start_timeout_s
            self.stop()
            raise ConfigError(f"{self.name}: the watch thread did not start") from None
        except BaseException:
            self._thread.join(self.timing.start_timeout_s)  # it is closing its connections
            raise

    def stop(self, timeout_s: float = 5.0) -> None:
        """Cancel the watch, close connections and wait for the thread (at most ``timeout_s``)."""
        loop, task = self._loop, self._main_task
        if loop is not None and task is not None and not self._stopping:
            self._stopping = True  # cancel once: a second cancel would cut the cleanup short
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(task.cancel)
        if self._thread is not None:
            self._thread.join(timeout_s)

    async def _run(self, started: concurrent.futures.Future[None]) -> None:
        """Connect, list (``_initial_sync``, bounded by ``start_timeout_s``), tell
        ``started``, then follow the changes until cancelled; close the client."""
        self._loop = asyncio.get_running_loop()
        self._main_task = asyncio.current_task()
        try:
            api = make_client(self.config, request_timeout_s=self.timing.request_timeout_s)
        except ConfigError as exc:
            started.set_exception(exc)
            return
        try:
            try:
                await asyncio.wait_for(self._initial_sync(api), self.timing.start_timeout_s)
            except TimeoutError:
                started.set_exception(self._start_error())
                return
            except Exception as exc:  # a bug, e.g. in on_change: logged, and start() fails
                log.exception("%s: start-up failed", self.name)
                started.set_exception(ConfigError(f"{self.name}: start-up failed: {exc!r}"))
                return
            started.set_result(None)
            await self._follow()
        except asyncio.CancelledError:
            pass  # stop(): the normal end
        finally:
            if not started.done():
                started.set_exception(ConfigError(f"{self.name}: stopped while starting"))
            await self._stop_following()
            await api.close()

    async def _initial_sync(self, api: AsyncClient) -> None:
        """The first list, retried on failures (``_last_error``) until cancelled."""
        raise NotImplementedError

    async def _follow(self) -> None:
        """Watch until cancelled."""
        raise NotImplementedError

    async def _stop_following(self) -> None:
        """Cancelled: end what ``_follow`` started."""

    def _backoff(self) -> Backoff:
        return Backoff(self.timing.backoff_initial_s, self.timing.backoff_max_s)

    def _start_error(self) -> ConfigError:
        return ConfigError(
            f"{self.name}: could not list from the Kubernetes API server "
            f"{self.config.cluster.server} ({describe(self.config)}) within "
            f"{self.timing.start_timeout_s:g} s: "
            f"{self._last_error or 'no answer'}"
        )


class KubePodSource(WatchThread):
    """Publishes Kubernetes pods as ``tuple[Pod, ...]`` (see the module docstring).

    Args:
        config: the API server and credentials.
        on_change: called with the new tuple whenever it changes (from the watch thread).
        namespace: where the pods (and the pool) are.
        target: selector mode: the label selector and the port.
        pool: pool mode: the InferencePool's name (exactly one of target and pool).
        pool_api: the pool's ``group/version``.
        mapping: how labels and annotations become models and roles (default ``PodMapping()``).
        timing: timeouts and backoff (default ``WatchTiming()``).
    """

    def __init__(
        self,
        config: SingleConfig,
        on_change: Callable[[tuple[Pod, ...]], Any],
        *,
        namespace: str,
        target: PodTarget | None = None,
        pool: str | None = None,
        pool_api: str = DEFAULT_POOL_API,
        mapping: PodMapping | None = None,
        timing: WatchTiming | None = None,
    ) -> None:
        if (target is None) == (pool is None):
            raise ValueError("give exactly one of target (selector mode) and pool")
        if target is not None:
            try:
                parse_selector(target.selector)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        self.config = config
        self.namespace = namespace
        self.mapping = mapping or PodMapping()
        self.timing = timing or WatchTiming()
        self.pool = pool
        self.pool_api = pool_api
        self.name = (
            f"InferencePool {namespace}/{pool}"
            if pool
            else f"pods in {namespace} matching {target.selector if target else ''}"
        )
        self.pods: tuple[Pod, ...] = ()
        self._on_change = on_change
        self._target = target
        self._pods: Reflector[K8sPod, tuple[Pod, ...]] | None = None
        self._pods_task: asyncio.Task[None] | None = None
        self._pool: Reflector[GenericNamespacedResource, PodTarget | None] | None = None
        self._watching = False
        self._problems: set[tuple[PodId, str]] = set()
        self._last_error: KubeApiError | None = None
        self._thread_name = f"k8s-watch:{self.namespace}/{self.pool or 'pods'}"

    async def _follow(self) -> None:
        await self._watch()

    async def _stop_following(self) -> None:
        if self._pods_task is not None:
            self._pods_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pods_task

    async def _initial_sync(self, api: AsyncClient) -> None:
        """List the pool (pool mode) and the pods, retrying until the caller's timeout."""
        backoff = self._backoff()
        while True:
            try:
                if self.pool is not None:
                    if self._pool is None:
                        self._pool = self._pool_reflector(api)
                    await self._pool.list()  # sets the target and the pods reflector
                elif self._pods is None and self._target is not None:
                    self._pods = self._pods_reflector(api, self._target)
                if self._pods is not None:
                    await self._pods.list()
                return
            except KubeApiError as exc:
                self._last_error = exc
                delay_s = backoff.next_delay_s()
                log.warning("%s: %s; retrying in %.1f s", self.name, exc, delay_s)
                await asyncio.sleep(delay_s)

    async def _watch(self) -> None:
        self._watching = True
        if self._pool is not None:
            if self._pods is not None:
                self._pods_task = asyncio.create_task(self._pods.run())
            await self._pool.run()
        else:
            assert self._pods is not None
            await self._pods.run()

    def _pods_reflector(
        self, api: AsyncClient, target: PodTarget
    ) -> Reflector[K8sPod, tuple[Pod, ...]]:
        def convert(obj: K8sPod) -> tuple[Pod, ...]:
            return make_pods(obj, self.mapping, target.target_ports)

        return Reflector(
            api,
            K8sPod,
            namespace=self.namespace,
            labels=parse_selector(target.selector),
            convert=convert,
            on_change=self._publish,
            what=f"pods in {self.namespace} matching {target.selector} ({_ports(target)})",
            backoff=self._backoff(),
            watch_timeout_s=self.timing.watch_timeout_s,
        )

    def _pool_reflector(
        self, api: AsyncClient
    ) -> Reflector[GenericNamespacedResource, PodTarget | None]:
        group, _, version = self.pool_api.rpartition("/")
        pool_resource = create_namespaced_resource(
            group, version, "InferencePool", "inferencepools", verbs=["list", "watch"]
        )
        assert self.pool is not None
        return Reflector(
            api,
            pool_resource,
            namespace=self.namespace,
            fields={"metadata.name": self.pool},
            convert=self._convert_pool,
            on_change=self._pool_changed,
            what=self.name,
            backoff=self._backoff(),
            watch_timeout_s=self.timing.watch_timeout_s,
        )

    def _convert_pool(self, obj: GenericNamespacedResource) -> PodTarget | None:
        try:
            return parse_pool(obj)
        except ValueError as exc:
            log.warning("%s: %s; keeping the current pods", self.name, exc)
            return None

    def _pool_changed(self) -> None:
        """Point the pod watch at the pool's current selector and port."""
        assert self._pool is not None
        if not self._pool.items:
            target = None
            log.warning("%s does not exist: no pods until it does", self.name)
        elif (parsed := next(iter(self._pool.items.values()))) is not None:
            target = parsed
        else:
            return  # an invalid pool keeps the current target
        if target == self._target:
            return
        log.info(
            "%s: selecting %s",
            self.name,
            f"pods matching {target.selector} on {_ports(target)}" if target else "none",
        )
        self._target = target
        if self._pods_task is not None:
            self._pods_task.cancel()
            self._pods_task = None
        self._pods = self._pods_reflector(self._pool.client, target) if target else None
        if self._pods is None:
            self._publish()
        elif self._watching:
            self._pods_task = asyncio.create_task(self._pods.run())

    def _publish(self) -> None:
        endpoints = itertools.chain.from_iterable(self._pods.items.values() if self._pods else ())
        pods, dropped = make_snapshot(endpoints)
        problems = {(p.id, w) for p in pods for w in pod_warnings(p, self.mapping)}
        problems |= {(p.id, f"ignored: another pod has its address {p.address}") for p in dropped}
        for pod_id, problem in sorted(problems - self._problems):
            log.warning("pod %s: %s", pod_id, problem)
        self._problems = problems
        if pods == self.pods:
            return
        log.info("%s: %d pods, %d ready", self.name, len(pods), sum(p.ready for p in pods))
        self._on_change(pods)
        self.pods = pods  # after on_change: if it raised, the next change publishes again


def _ports(target: PodTarget) -> str:
    ports = target.target_ports
    return f"port {ports[0]}" if len(ports) == 1 else f"ports {', '.join(map(str, ports))}"
