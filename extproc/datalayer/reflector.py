"""A local mirror of one Kubernetes collection, kept by list + watch (client-go's Reflector).

Rules:

* ``list()`` replaces the mirror with the collection and remembers its resourceVersion.
* ``run()`` watches from the remembered resourceVersion, forever:
  ``ADDED``/``MODIFIED`` store the converted object, ``DELETED`` drops it, ``BOOKMARK``
  only moves the resourceVersion on; every event moves it on.
* A watch the server ends (its timeout) or that drops is resumed from the last
  resourceVersion, without a list, so no change is lost or repeated.
* 410 Gone on a watch (HTTP status or ERROR event: the version was compacted) means
  list again at once; on a list (an expired ``continue`` token) it is a failure.
* Other failures (no answer, 5xx, 403, other ERROR events, a watch closing at once
  without events) wait ``Backoff`` (capped exponential, jittered), then resume or, if
  the mirror was never listed, list. A success resets the backoff.
* ``on_change()`` is called after a list and after an event that changed the mirror;
  an exception from it (or from ``convert``) is logged, then handled as a failure
  followed by a re-list, so a bug never ends the watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from extproc.datalayer.kubeapi import KubeApi, KubeApiError, WatchEvent

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_WATCH_TIMEOUT_S = 300.0  # the server ends each watch after this; we resume
# A watch ending sooner than this with no event did no work: count it as a failure, so a
# server that closes every stream at once is retried with backoff, not in a busy loop.
MIN_USEFUL_WATCH_S = 1.0


@dataclass(slots=True)
class Backoff:
    """Delays ``initial_s * 2**n`` capped at ``max_s``, each scaled by a 0.5-1.0 jitter."""

    initial_s: float = 0.5
    max_s: float = 30.0
    num_failures: int = 0

    def next_delay_s(self) -> float:
        delay_s = min(self.max_s, self.initial_s * 2.0 ** min(self.num_failures, 30))
        self.num_failures += 1
        return delay_s * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.num_failures = 0


class Reflector(Generic[T]):
    """Mirror of ``path`` (a collection URL) as ``items``: object name -> ``convert(obj)``.

    Args:
        api: the client.
        path: e.g. ``/api/v1/namespaces/NS/pods``.
        params: selectors, e.g. ``{"labelSelector": "app=vllm"}``.
        convert: object JSON -> stored value (values are compared to skip no-op events).
        on_change: called after the mirror changed; reads ``items``.
        what: names the collection in logs, e.g. ``pods in llm (app=vllm)``.
        backoff: retry delays.
        watch_timeout_s: asks the server to end each watch after this long.
    """

    def __init__(
        self,
        api: KubeApi,
        path: str,
        *,
        params: Mapping[str, str],
        convert: Callable[[dict[str, Any]], T],
        on_change: Callable[[], object],
        what: str,
        backoff: Backoff | None = None,
        watch_timeout_s: float = DEFAULT_WATCH_TIMEOUT_S,
    ) -> None:
        self.api = api
        self.path = path
        self.params = dict(params)
        self.convert = convert
        self.on_change = on_change
        self.what = what
        self.backoff = backoff or Backoff()
        self.watch_timeout_s = watch_timeout_s
        self.items: dict[str, T] = {}
        self.resource_version: str | None = None

    async def list(self) -> None:
        """Replace the mirror with a fresh list and call ``on_change``.

        Raises:
            KubeApiError: the list failed; the mirror is unchanged.
        """
        result = await self.api.list(self.path, self.params)
        self.items = {_name(obj): self.convert(obj) for obj in result.items}
        self.resource_version = result.resource_version
        self.backoff.reset()
        log.info(
            "%s: listed %d at resourceVersion %s",
            self.what,
            len(self.items),
            self.resource_version,
        )
        self.on_change()

    async def run(self) -> None:
        """List if never listed, then watch and resume until cancelled; never raises."""
        while True:
            try:
                if self.resource_version is None:
                    await self.list()
                await self._watch_once()
            except KubeApiError as exc:
                listing = self.resource_version is None
                if exc.gone and not listing:
                    log.info("%s: %s; listing again", self.what, exc)
                    self.resource_version = None
                    continue
                await self._wait_after_failure(str(exc))  # a list's 410 too: no busy loop
            except Exception:  # a bug in convert or on_change: log it, start over
                log.exception("%s: error while applying a change; listing again", self.what)
                self.resource_version = None
                await self._wait_after_failure("the error above")

    async def _watch_once(self) -> None:
        assert self.resource_version is not None
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        num_events = 0
        events = self.api.watch(
            self.path,
            self.params,
            resource_version=self.resource_version,
            timeout_s=self.watch_timeout_s,
        )
        async with contextlib.aclosing(events):
            async for event in events:
                num_events += 1
                self.backoff.reset()
                self._apply(event)
        if num_events == 0 and loop.time() - started_s < MIN_USEFUL_WATCH_S:
            await self._wait_after_failure("the watch closed at once without events")
        else:
            log.debug("%s: watch ended; resuming at %s", self.what, self.resource_version)

    def _apply(self, event: WatchEvent) -> None:
        obj = event.object
        resource_version = (obj.get("metadata") or {}).get("resourceVersion")
        if event.type in ("ADDED", "MODIFIED"):
            name = _name(obj)
            value = self.convert(obj)
            changed = name not in self.items or self.items[name] != value
            self.items[name] = value
        elif event.type == "DELETED":
            name = _name(obj)
            changed = name in self.items
            self.items.pop(name, None)
        elif event.type == "BOOKMARK":
            changed = False
        else:
            log.warning("%s: ignoring a watch event of type %r", self.what, event.type)
            return
        if resource_version:
            self.resource_version = str(resource_version)
        if changed:
            self.on_change()

    async def _wait_after_failure(self, problem: str) -> None:
        delay_s = self.backoff.next_delay_s()
        log.warning(
            "%s: %s; retrying in %.1f s (failure %d in a row)",
            self.what,
            problem,
            delay_s,
            self.backoff.num_failures,
        )
        await asyncio.sleep(delay_s)


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))
