"""A local mirror of one Kubernetes collection, kept by list + watch (client-go's Reflector).

lightkube lists (paged) and watches; what a mirror needs on top is here, since
lightkube's own retry restarts a 410 watch from "now" without telling which objects went
away meanwhile. Rules:

* ``list()`` replaces the mirror with the collection and remembers its resourceVersion.
* ``run()`` watches from the remembered resourceVersion, forever:
  ``ADDED``/``MODIFIED`` store the converted object, ``DELETED`` drops it, ``BOOKMARK``
  only moves the resourceVersion on; every event moves it on.
* A watch the server ends (its timeout) is resumed by lightkube from the last
  resourceVersion; one that drops, or is silent past its timeout, is resumed here, without
  a list, so no change is lost or repeated.
* 410 Gone on a watch (HTTP status or ERROR event: the version was compacted) means
  list again at once; on a list (an expired ``continue`` token) it is a failure.
* Other failures (no answer, 5xx, 403, other ERROR events, credentials) wait ``Backoff``
  (capped exponential, jittered), then resume or, if the mirror was never listed, list.
  A success resets the backoff.
* ``on_change()`` is called after a list and after an event that changed the mirror;
  an exception from it (or from ``convert``) is logged, then handled as a failure
  followed by a re-list, so a bug never ends the watch.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import httpx2
import msgspec
from lightkube import ApiError, AsyncClient
from lightkube import ConfigError as LightkubeConfigError
from lightkube.core.client import FieldSelector, LabelSelector
from lightkube.core.exceptions import NotReadyError
from lightkube.core.resource import NamespacedResource

log = logging.getLogger(__name__)

R = TypeVar("R", bound=NamespacedResource)
T = TypeVar("T")

DEFAULT_WATCH_TIMEOUT_S = 300.0  # the server ends each watch after this; lightkube resumes
# A watch silent this much longer than its timeout is dead (a peer that vanished without
# a FIN): lightkube sets no read timeout on watches. Bookmarks keep a live one talking.
WATCH_READ_SLACK_S = 30.0
DEFAULT_PAGE_SIZE = 500
# What a failed request raises through lightkube: HTTP and transport errors (ApiError is an
# httpx2.HTTPStatusError), credential errors (token file, exec plugin), an unparsable body.
API_ERRORS = (httpx2.HTTPError, LightkubeConfigError, OSError, msgspec.MsgspecError)


class KubeApiError(Exception):
    """A failed list or watch; ``status`` is the HTTP/Status code, 0 when none came back."""

    def __init__(self, message: str, *, status: int = 0) -> None:
        super().__init__(message)
        self.status = status

    @property
    def gone(self) -> bool:
        """410: the requested resourceVersion is too old; list again."""
        return self.status == 410


def api_error(what: str, exc: BaseException) -> KubeApiError:
    """Name the request and the server's ``Status`` (code, reason, message) in one line."""
    status = 0
    if isinstance(exc, ApiError):
        status = exc.status.code or 0
        reason = exc.status.reason or ""
        text = f"{status} {reason}".strip() + f": {exc.status.message or ''}"
        if exc.response is None:  # lightkube raises a watch's ERROR event without a response
            text = f"ERROR event: {text}"
    elif isinstance(exc, httpx2.HTTPStatusError):  # not JSON, or a watch's (body unread)
        status = exc.response.status_code
        try:
            text = f"{status}: {exc.response.text[:200].strip()}"
        except httpx2.ResponseNotRead:
            text = f"{status} {exc.response.reason_phrase}"
    elif isinstance(exc, TimeoutError | httpx2.TimeoutException):
        text = "timed out"
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    hint = " (check the RBAC rules in extproc/datalayer/k8s.py)" if status in (401, 403) else ""
    return KubeApiError(f"{what}: {text}{hint}", status=status)


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


class Reflector(Generic[R, T]):
    """Mirror of one resource kind in a namespace as ``items``: name -> ``convert(obj)``.

    Args:
        client: the lightkube client.
        resource: e.g. ``lightkube.resources.core_v1.Pod`` or a generic resource.
        namespace: where the objects are.
        labels: a label selector in lightkube's form (``{"app": "vllm"}``).
        fields: a field selector in lightkube's form (``{"metadata.name": "pool"}``).
        convert: object -> stored value (values are compared to skip no-op events).
        on_change: called after the mirror changed; reads ``items``.
        what: names the collection in logs, e.g. ``pods in llm (app=vllm)``.
        backoff: retry delays.
        watch_timeout_s: asks the server to end each watch after this long.
        page_size: objects per list request.
    """

    def __init__(
        self,
        client: AsyncClient,
        resource: type[R],
        *,
        namespace: str,
        labels: LabelSelector | None = None,
        fields: FieldSelector | None = None,
        convert: Callable[[R], T],
        on_change: Callable[[], object],
        what: str,
        backoff: Backoff | None = None,
        watch_timeout_s: float = DEFAULT_WATCH_TIMEOUT_S,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> None:
        self.client = client
        self.resource = resource
        self.namespace = namespace
        self.labels = labels
        self.fields = fields
        self.convert = convert
        self.on_change = on_change
        self.what = what
        self.backoff = backoff or Backoff()
        self.watch_timeout_s = watch_timeout_s
        self.page_size = page_size
        self.items: dict[str, T] = {}
        self.resource_version: str | None = None

    async def list(self) -> None:
        """Replace the mirror with a fresh list and call ``on_change``.

        Raises:
            KubeApiError: the list failed; the mirror is unchanged.
        """
        objects = self.client.list(
            self.resource,
            namespace=self.namespace,
            chunk_size=self.page_size,
            labels=self.labels,
            fields=self.fields,
        )
        try:
            listed = [obj async for obj in objects]
            resource_version = objects.resourceVersion
        except (*API_ERRORS, NotReadyError) as exc:
            raise api_error(f"list {self.what}", exc) from exc
        self.items = {_name(obj): self.convert(obj) for obj in listed}
        self.resource_version = resource_version
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
                await self._watch()
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

    async def _watch(self) -> None:
        """Apply events until the watch fails or falls silent (lightkube resumes the rest)."""
        assert self.resource_version is not None
        what = f"watch {self.what} from resourceVersion {self.resource_version}"
        events: AsyncIterable[tuple[str, R]] = self.client.watch(
            self.resource,
            namespace=self.namespace,
            labels=self.labels,
            fields=self.fields,
            server_timeout=max(1, int(self.watch_timeout_s)),
            resource_version=self.resource_version,
        )
        iterator = aiter(events)
        try:
            while True:
                try:
                    async with asyncio.timeout(self.watch_timeout_s + WATCH_READ_SLACK_S):
                        event_type, obj = await anext(iterator)
                except (*API_ERRORS, TimeoutError) as exc:
                    raise api_error(what, exc) from exc
                self.backoff.reset()
                self._apply(event_type, obj)
        finally:  # close the stream now, not when the generator is collected
            if (aclose := getattr(iterator, "aclose", None)) is not None:
                await aclose()

    def _apply(self, event_type: str, obj: R) -> None:
        resource_version = _metadata(obj, "resourceVersion")
        if event_type in ("ADDED", "MODIFIED"):
            name = _name(obj)
            value = self.convert(obj)
            changed = name not in self.items or self.items[name] != value
            self.items[name] = value
        elif event_type == "DELETED":
            name = _name(obj)
            changed = name in self.items
            self.items.pop(name, None)
        elif event_type == "BOOKMARK":
            changed = False
        else:
            log.warning("%s: ignoring a watch event of type %r", self.what, event_type)
            return
        if resource_version:
            self.resource_version = resource_version
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


def _name(obj: NamespacedResource) -> str:
    return _metadata(obj, "name") or ""


def _metadata(obj: NamespacedResource, field: str) -> str | None:
    """``obj.metadata.FIELD``: typed and generic resources both have it, the base class not."""
    metadata = getattr(obj, "metadata", None)
    value = getattr(metadata, field, None)
    return value if isinstance(value, str) else None
