"""A minimal async Kubernetes API client: paged list and streaming watch of a collection.

Discovery needs two calls, so they are written out on aiohttp (already a dependency)
rather than taken from a generated client:

* ``list(path, params)``: ``GET path?limit=N[&continue=TOKEN]`` until no ``continue``;
  returns the items and the collection's ``metadata.resourceVersion``.
* ``watch(path, params, resource_version=RV)``: ``GET path?watch=1&resourceVersion=RV
  &allowWatchBookmarks=true&timeoutSeconds=T``; yields one ``WatchEvent`` per JSON line
  (``ADDED``, ``MODIFIED``, ``DELETED``, ``BOOKMARK``) until the server ends the stream.

Every failure, foreign or not, leaves as ``KubeApiError`` (translated here, where it
enters): a non-200 answer or an ``ERROR`` event carries the ``Status`` code (410 Gone:
the resource version was compacted), a transport failure or an unparsable answer has
status 0. Callers decide about retries; nothing here sleeps or loops forever.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Any, NamedTuple

import aiohttp
import orjson

from extproc.datalayer.kubeconfig import KubeConfig
from extproc.errors import ConfigError

# A watch stream is silent between events, but the server sends a BOOKMARK about once a
# minute and ends the stream after timeoutSeconds; a socket silent this much longer than
# that is dead (a peer that vanished without a FIN).
WATCH_READ_SLACK_S = 30.0
# One event is one object; etcd caps objects at 1.5 MiB, so 16 MiB is a broken stream.
MAX_EVENT_BYTES = 16 << 20
DEFAULT_PAGE_SIZE = 500


class KubeApiError(Exception):
    """A failed list or watch; ``status`` is the HTTP/Status code, 0 when none came back."""

    def __init__(self, message: str, *, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason

    @property
    def gone(self) -> bool:
        """410: the requested resourceVersion is too old; list again."""
        return self.status == 410


class WatchEvent(NamedTuple):
    type: str  # ADDED | MODIFIED | DELETED | BOOKMARK
    object: dict[str, Any]


class ListResult(NamedTuple):
    items: list[dict[str, Any]]
    resource_version: str


class KubeApi:
    """List and watch collections on one API server; ``close()`` when done.

    The aiohttp session is made on first use, in the caller's event loop.
    """

    def __init__(
        self,
        config: KubeConfig,
        *,
        request_timeout_s: float = 10.0,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> None:
        self.config = config
        self.request_timeout_s = request_timeout_s
        self.page_size = page_size
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def list(self, path: str, params: Mapping[str, str]) -> ListResult:
        """All items of a collection, page by page, and its resourceVersion.

        Raises:
            KubeApiError: any page failed (a 410 means a ``continue`` token expired).
        """
        query = {**params, "limit": str(self.page_size)}
        items: list[dict[str, Any]] = []
        while True:
            body = await self._get_json(path, query)
            items.extend(item for item in body.get("items") or () if isinstance(item, dict))
            metadata = body.get("metadata") or {}
            if token := metadata.get("continue"):
                query["continue"] = str(token)
                continue
            if not (resource_version := metadata.get("resourceVersion")):
                raise KubeApiError(f"list {path}: the answer has no metadata.resourceVersion")
            return ListResult(items, str(resource_version))

    async def watch(
        self, path: str, params: Mapping[str, str], *, resource_version: str, timeout_s: float
    ) -> AsyncGenerator[WatchEvent, None]:
        """Stream the changes after ``resource_version`` until the server ends the watch.

        Use it under ``contextlib.aclosing`` so that leaving early closes the connection.

        Raises:
            KubeApiError: the request failed, the stream broke, or an ERROR event came.
        """
        query = {
            **params,
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(max(1, int(timeout_s))),
        }
        timeout = aiohttp.ClientTimeout(
            sock_connect=self.request_timeout_s, sock_read=timeout_s + WATCH_READ_SLACK_S
        )
        what = f"watch {path} from resourceVersion {resource_version}"
        try:
            async with self._get_session().get(
                self.config.server + path, params=query, headers=self._headers(), timeout=timeout
            ) as resp:
                if resp.status != 200:
                    raise _status_error(what, resp.status, await resp.read())
                pending = bytearray()
                async for chunk in resp.content.iter_any():
                    pending += chunk
                    while (end := pending.find(b"\n")) >= 0:
                        line = bytes(pending[:end])
                        del pending[: end + 1]
                        if line.strip():
                            yield _parse_event(what, line)
                    if len(pending) > MAX_EVENT_BYTES:
                        raise KubeApiError(f"{what}: an event is over {MAX_EVENT_BYTES} bytes")
                if pending.strip():
                    yield _parse_event(what, bytes(pending))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise KubeApiError(f"{what}: {_describe(exc)}") from exc

    async def _get_json(self, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        what = f"list {path}"
        try:
            async with self._get_session().get(
                self.config.server + path,
                params=params,
                headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            ) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise _status_error(what, resp.status, body)
                data = orjson.loads(body)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise KubeApiError(f"{what}: {_describe(exc)}") from exc
        if not isinstance(data, dict):
            raise KubeApiError(f"{what}: expected a JSON object, got {type(data).__name__}")
        return data

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            ssl_context = self.config.ssl_context
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_context if ssl_context else True),
                headers={"Accept": "application/json", "User-Agent": "extproc"},
            )
        return self._session

    def _headers(self) -> dict[str, str]:
        try:
            authorization = self.config.authorization()
        except ConfigError as exc:
            raise KubeApiError(str(exc)) from exc
        return {"Authorization": authorization} if authorization else {}


def _parse_event(what: str, line: bytes) -> WatchEvent:
    event = orjson.loads(line)
    if not isinstance(event, dict) or not isinstance(obj := event.get("object"), dict):
        raise KubeApiError(f"{what}: not a watch event: {line[:200]!r}")
    kind = str(event.get("type", ""))
    if kind == "ERROR":
        raise _status_error(f"{what}: ERROR event", int(obj.get("code") or 0), line, obj)
    return WatchEvent(kind, obj)


def _status_error(
    what: str, status: int, body: bytes, parsed: dict[str, Any] | None = None
) -> KubeApiError:
    """Build the error from a ``Status`` object (the API server's error body) if there is one."""
    if parsed is None:
        try:
            loaded = orjson.loads(body)
        except ValueError:
            loaded = None
        parsed = loaded if isinstance(loaded, dict) else {}
    reason = str(parsed.get("reason") or "")
    message = str(parsed.get("message") or body[:200].decode("utf-8", "replace").strip())
    hint = " (check the RBAC rules in extproc/datalayer/k8s.py)" if status in (401, 403) else ""
    code = f"{status} {reason}" if reason else str(status)
    return KubeApiError(f"{what}: {code}: {message}{hint}", status=status, reason=reason)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
