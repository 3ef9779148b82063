"""A fake Kubernetes API server for discovery tests: list + watch with resource versions.

It runs aiohttp on 127.0.0.1:0 in its own thread. Any namespaced collection works:
``/api/v1/namespaces/NS/pods``, ``/apis/GROUP/VERSION/namespaces/NS/RESOURCE``.

* ``GET COLLECTION`` lists (``labelSelector``, ``fieldSelector=metadata.name=X``,
  ``limit`` + ``continue``) at the current resourceVersion.
* ``GET COLLECTION?watch=1&resourceVersion=RV`` replays the changes after RV, then
  streams new ones as JSON lines until ``timeoutSeconds``; a label change that moves an
  object into or out of the selector is sent as ADDED or DELETED, as the real server does.
  A watch from before ``compact()`` gets 410 Gone: an HTTP 410, or with
  ``gone_as_event`` a 200 stream with one ERROR event.

``hold_watches`` keeps streams open past ``timeoutSeconds``, as a dead peer would look.
The test drives it from its own thread: ``put``/``delete`` objects, ``bookmark()``,
``error_event()``, ``drop_watches()`` (clean end or abrupt close), ``fail_next()``, and
reads ``requests`` to see what the client asked.
"""

from __future__ import annotations

import asyncio
import copy
import ssl
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import orjson
from aiohttp import web

from testkit.waiting import wait_until

R = TypeVar("R")
Obj = dict[str, Any]


@dataclass
class Request:
    kind: str  # "list" | "watch"
    path: str
    query: dict[str, str]
    authorization: str | None


@dataclass
class _Change:
    resource_version: int
    path: str
    type: str  # ADDED | MODIFIED | DELETED
    old: Obj | None
    new: Obj


@dataclass(eq=False)
class _Watch:
    path: str
    query: dict[str, str]
    queue: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    request: web.Request | None = None


class FakeKube:
    """See the module docstring; use as a context manager."""

    def __init__(
        self, *, ssl_context: ssl.SSLContext | None = None, token: str | None = None
    ) -> None:
        self.ssl_context = ssl_context
        self.token = token  # when set, requests must carry "Bearer <token>"
        self.gone_as_event = False
        self.hold_watches = False  # ignore timeoutSeconds: a stream that stays silently open
        self.requests: list[Request] = []
        self._resource_version = 100
        self._compacted_rv = 0
        self._objects: dict[str, dict[str, Obj]] = {}
        self._history: list[_Change] = []
        self._watches: set[_Watch] = set()
        self._failures: list[int] = []
        self._paused = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="fake-kube", daemon=True
        )
        self._runner: web.AppRunner | None = None
        self.url = ""

    def __enter__(self) -> Self:
        self._thread.start()
        self.url = self._call_async(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call_async(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    # -- driving it from the test thread --------------------------------------------------

    def put(self, path: str, obj: Obj) -> int:
        """Create or replace an object; returns its new resourceVersion."""
        return self._call(self._put, path, copy.deepcopy(obj))

    def delete(self, path: str, name: str) -> int:
        return self._call(self._delete, path, name)

    def compact(self) -> None:
        """Forget the history: watches from any earlier resourceVersion get 410 Gone."""
        self._call(self._compact)

    def bookmark(self) -> int:
        """Send every open watch a BOOKMARK at the current resourceVersion."""
        return self._call(self._bookmark)

    def error_event(self, code: int, message: str = "injected") -> None:
        """Send every open watch an ERROR event (a Status) and end it."""
        self._call(self._error_event, code, message)

    def drop_watches(self, *, abrupt: bool = False) -> int:
        """End every open watch: cleanly (as on timeout) or by closing the connection."""
        return self._call(self._drop_watches, abrupt)

    def pause_watches(self, paused: bool) -> None:
        """While paused, changes are recorded but not sent to open watches (a partition)."""
        self._call(setattr, self, "_paused", paused)

    def fail_next(self, *statuses: int) -> None:
        """Answer the next requests (list or watch) with these HTTP statuses."""
        self._call(self._failures.extend, statuses)

    def num_watches(self) -> int:
        return self._call(len, self._watches)

    def requests_of(self, kind: str) -> list[Request]:
        return self._call(lambda: [r for r in self.requests if r.kind == kind])

    def wait_for_watches(self, count: int, timeout_s: float = 5.0) -> None:
        wait_until(
            lambda: self.num_watches() >= count,
            timeout_s,
            what=lambda: f"{count} open watches, have {self.num_watches()}",
        )

    @property
    def resource_version(self) -> int:
        return self._call(lambda: self._resource_version)

    # -- inside the server loop -----------------------------------------------------------

    def _call(self, fn: Callable[..., R], *args: Any) -> R:
        async def run() -> R:
            return fn(*args)

        return self._call_async(run())

    def _call_async(self, coro: Coroutine[Any, Any, R]) -> R:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(5)

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/{version}/namespaces/{ns}/{resource}", self._handle)
        app.router.add_get("/apis/{group}/{version}/namespaces/{ns}/{resource}", self._handle)
        # handler_cancellation: a watch whose client went away ends at once, as on a real server
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=0.5, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{port}"

    async def _stop(self) -> None:
        self._drop_watches(abrupt=False)
        # The clients have stopped, but a connection of theirs may still wait in the listen
        # backlog: accept it before closing the site, since on Python 3.11 a connection
        # accepted after the close is never closed (Server._attach fails half-way).
        await asyncio.sleep(0.01)
        if self._runner is not None:
            await self._runner.cleanup()
        await asyncio.sleep(0.01)  # let the closed transports run their connection_lost

    def _put(self, path: str, obj: Obj) -> int:
        self._resource_version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._resource_version)
        name = obj["metadata"]["name"]
        old = self._objects.setdefault(path, {}).get(name)
        self._objects[path][name] = obj
        self._record(
            _Change(self._resource_version, path, "MODIFIED" if old else "ADDED", old, obj)
        )
        return self._resource_version

    def _delete(self, path: str, name: str) -> int:
        old = self._objects.get(path, {}).pop(name)
        self._resource_version += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self._resource_version)
        self._record(_Change(self._resource_version, path, "DELETED", old, gone))
        return self._resource_version

    def _record(self, change: _Change) -> None:
        self._history.append(change)
        for watch in () if self._paused else self._watches:
            if (line := _event_line(watch, change)) is not None:
                watch.queue.put_nowait(line)

    def _compact(self) -> None:
        self._compacted_rv = self._resource_version
        self._history.clear()

    def _bookmark(self) -> int:
        rv = str(self._resource_version)
        line = _line({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": rv}}})
        for watch in self._watches:
            watch.queue.put_nowait(line)
        return self._resource_version

    def _error_event(self, code: int, message: str) -> None:
        line = _line({"type": "ERROR", "object": _status(code, message)})
        for watch in self._watches:
            watch.queue.put_nowait(line)
            watch.queue.put_nowait(None)

    def _drop_watches(self, abrupt: bool) -> int:
        dropped = len(self._watches)
        for watch in list(self._watches):
            if abrupt and watch.request is not None and watch.request.transport is not None:
                watch.request.transport.close()
            watch.queue.put_nowait(None)
        return dropped

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        watching = query.get("watch") in ("1", "true")
        path = request.path
        self.requests.append(
            Request(
                "watch" if watching else "list", path, query, request.headers.get("Authorization")
            )
        )
        if (
            self.token is not None
            and request.headers.get("Authorization") != f"Bearer {self.token}"
        ):
            return _status_response(401, "Unauthorized")
        if self._failures:
            return _status_response(self._failures.pop(0), "injected failure")
        if watching:
            return await self._watch(request, path, query)
        return self._list(path, query)

    def _list(self, path: str, query: dict[str, str]) -> web.Response:
        watch = _Watch(path, query)
        items = [o for _, o in sorted(self._objects.get(path, {}).items()) if _matches(watch, o)]
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or 0) or len(items)
        metadata: Obj = {"resourceVersion": str(self._resource_version)}
        if start + limit < len(items):
            metadata["continue"] = str(start + limit)
        body = {"kind": "List", "metadata": metadata, "items": items[start : start + limit]}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _watch(
        self, request: web.Request, path: str, query: dict[str, str]
    ) -> web.StreamResponse:
        since = int(query.get("resourceVersion") or 0)
        if since < self._compacted_rv:
            gone = _status(410, f"too old resource version: {since} ({self._compacted_rv})")
            if not self.gone_as_event:
                return web.Response(
                    status=410, body=orjson.dumps(gone), content_type="application/json"
                )
        resp = web.StreamResponse()
        resp.content_type = "application/json"
        watch = _Watch(path, query, request=request)
        for change in self._history:
            if change.resource_version > since and (line := _event_line(watch, change)):
                watch.queue.put_nowait(line)
        self._watches.add(watch)
        timeout_s = 3600.0 if self.hold_watches else float(query.get("timeoutSeconds") or 300)
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            await resp.prepare(request)
            if since < self._compacted_rv:
                await resp.write(_line({"type": "ERROR", "object": gone}))
                return resp
            while True:
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    line = await asyncio.wait_for(watch.queue.get(), max(0.0, remaining))
                except TimeoutError:
                    break
                if line is None:
                    break
                await resp.write(line)
        except ConnectionError:
            pass
        finally:
            self._watches.discard(watch)
        return resp


def _event_line(watch: _Watch, change: _Change) -> bytes | None:
    if change.path != watch.path:
        return None
    was_in = change.old is not None and _matches(watch, change.old)
    is_in = _matches(watch, change.new)
    if change.type == "DELETED":
        kind = "DELETED" if was_in else None
    elif is_in:
        kind = "MODIFIED" if was_in else "ADDED"
    else:
        kind = "DELETED" if was_in else None
    return None if kind is None else _line({"type": kind, "object": change.new})


def _matches(watch: _Watch, obj: Obj) -> bool:
    """Equality, inequality and existence label selectors; metadata.name field selector."""
    metadata = obj.get("metadata", {})
    labels = metadata.get("labels") or {}
    for term in filter(None, watch.query.get("labelSelector", "").split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    field_selector = watch.query.get("fieldSelector", "")
    if field_selector.startswith("metadata.name="):
        return bool(metadata.get("name") == field_selector.split("=", 1)[1])
    return True


def _status(code: int, message: str) -> Obj:
    reasons = {401: "Unauthorized", 403: "Forbidden", 410: "Expired", 500: "InternalError"}
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reasons.get(code, ""),
        "code": code,
    }


def _status_response(code: int, message: str) -> web.Response:
    return web.Response(
        status=code, body=orjson.dumps(_status(code, message)), content_type="application/json"
    )


def _line(event: Obj) -> bytes:
    return orjson.dumps(event) + b"\n"


def k8s_pod(
    name: str,
    ip: str | None = "10.0.0.1",
    *,
    namespace: str = "ns",
    ready: bool = True,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    phase: str = "Running",
    deleting: bool = False,
) -> Obj:
    """A pod object as the API server returns it (only the fields discovery reads)."""
    metadata: Obj = {
        "name": name,
        "namespace": namespace,
        "labels": {"app": "vllm", "extproc.io/model": "m"} if labels is None else labels,
        "annotations": annotations or {},
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: Obj = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": status}


def inference_pool(
    name: str, selector: dict[str, str], port: int, *, namespace: str = "ns", v1: bool = True
) -> Obj:
    """An InferencePool in the v1 shape, or the v1alpha2 one."""
    if v1:
        spec: Obj = {
            "selector": {"matchLabels": selector},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"name": "extproc", "port": {"number": 9002}},
        }
        api_version = "inference.networking.k8s.io/v1"
    else:
        spec = {"selector": selector, "targetPortNumber": port, "extensionRef": {"name": "extproc"}}
        api_version = "inference.networking.x-k8s.io/v1alpha2"
    return {
        "apiVersion": api_version,
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def inference_objective(
    name: str, priority: Any = None, pool: str | None = "pool", *, namespace: str = "ns"
) -> Obj:
    """A v1alpha2 InferenceObjective; ``priority`` None leaves it out, ``pool`` None the poolRef."""
    spec: Obj = {}
    if priority is not None:
        spec["priority"] = priority
    if pool is not None:
        spec["poolRef"] = {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": pool,
        }
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }
