"""The admin port (as Envoy's): debug endpoints for people and tools, off by default.

``serve --admin-port N`` starts it, bound to ``--admin-address`` (127.0.0.1 unless told
otherwise: it has no authentication, and ``/debug/pick`` runs the scheduler on what it
is sent). Routes (``AdminServer.routes``, extendable with ``add_route``):

* ``GET /``: a plain list of the routes, which the status page replaces
  (``admin.status_page.add_status_page``);
* ``GET /debug/pods``: each pod's state (``admin.state.pods_state``);
* ``POST /debug/pick``: the decision extproc would make now for the request given as
  ``{"path": ..., "headers": {...}, "body": {...}}``, or as its body itself (``?path=``,
  ``x-`` headers) (``routing.explain``); nothing is recorded, credited or counted;
* ``GET /debug/config``: the scheduler configuration in force, defaults filled in.

The stdlib ``ThreadingHTTPServer`` on a daemon thread rather than aiohttp: a few
small requests from people, no event loop to run beside gRPC's, and nothing of it on
the request path. Bodies are bounded (``max_body_bytes``, ``serve --max-body-bytes``);
every error is a JSON ``{"error": ...}`` with its status, never a stack trace.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from extproc.admin.state import config_state, pods_state
from extproc.datalayer.kv_events import KvEventsSubscriber
from extproc.datalayer.store import PodStore
from extproc.errors import ConfigError
from extproc.request.parse import DEFAULT_MAX_BODY_BYTES
from extproc.routing.explain import explain_pick
from extproc.routing.router import Router

log = logging.getLogger("extproc.admin")

READ_TIMEOUT_S = 10.0  # per socket read of a request


def add_admin_arguments(p: argparse.ArgumentParser, env: Callable[[str, Any], Any]) -> None:
    """``serve`` flags for the admin port."""
    g = p.add_argument_group(
        "Admin port", "debug endpoints and the status page (docs/operations/admin.md)"
    )
    g.add_argument(
        "--admin-port",
        type=int,
        default=env("admin-port", "0"),
        help="serve /, /debug/pods, /debug/pick and /debug/config on this port; 0: off "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--admin-address",
        default=env("admin-address", "127.0.0.1"),
        help="the admin port's bind address; it has no authentication, keep it local "
        "(default: %(default)s)",
    )


@dataclass(frozen=True, slots=True)
class AdminRequest:
    method: str
    path: str  # without the query
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]  # lower-case names
    body: bytes


@dataclass(frozen=True, slots=True)
class AdminResponse:
    status: int
    body: bytes
    content_type: str = "application/json"

    @classmethod
    def json(cls, value: Any, status: int = 200) -> AdminResponse:
        return cls(status, (json.dumps(value, indent=2) + "\n").encode())

    @classmethod
    def error(cls, status: int, message: str) -> AdminResponse:
        return cls.json({"error": message, "status": status}, status)

    @classmethod
    def html(cls, text: str) -> AdminResponse:
        return cls(200, text.encode(), "text/html; charset=utf-8")


Handler = Callable[[AdminRequest], AdminResponse]


class BadRequest(Exception):
    """A handler's 400 (or other status): answered as ``{"error": message}``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class AdminServer:
    """The admin HTTP server over a router; ``start``/``stop`` from ``cli.app``."""

    router: Router
    address: str = "127.0.0.1"
    port: int = 0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    config_source: str = ""  # a reload sets the new file's here
    store: PodStore | None = None
    kv_events: KvEventsSubscriber | None = None
    routes: dict[tuple[str, str], Handler] = field(default_factory=dict)
    started_s: float = field(default_factory=time.monotonic)
    _httpd: ThreadingHTTPServer | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        defaults: dict[tuple[str, str], Handler] = {
            ("GET", "/"): self._index,
            ("GET", "/debug/pods"): lambda _req: AdminResponse.json(self.pods_state()),
            ("GET", "/debug/config"): lambda _req: AdminResponse.json(
                config_state(self.router, self.config_source)
            ),
            ("POST", "/debug/pick"): self._pick,
        }
        for key, handler in defaults.items():
            self.routes.setdefault(key, handler)

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        """Serve ``method path`` with ``handler`` (replacing what served it)."""
        self.routes[(method.upper(), path)] = handler

    def pods_state(self) -> dict[str, Any]:
        """``/debug/pods``' answer (``admin.state.pods_state``), for other pages too."""
        return pods_state(
            self.router,
            config_source=self.config_source,
            uptime_s=time.monotonic() - self.started_s,
            store=self.store,
            kv_events=self.kv_events,
        )

    def start(self) -> int:
        """Bind and serve on a daemon thread; returns the port (``port=0``: any free one).

        Raises:
            OSError: the address cannot be bound (the message names it).
        """
        try:
            httpd = ThreadingHTTPServer((self.address, self.port), _handler_class(self))
        except OSError as exc:
            raise OSError(
                f"cannot bind the admin server to {self.address}:{self.port}: {exc.strerror or exc}"
            ) from None
        httpd.daemon_threads = True
        self._httpd = httpd
        self.port = httpd.server_address[1]
        self._thread = threading.Thread(
            target=httpd.serve_forever, name="admin-http", kwargs={"poll_interval": 0.2}
        )
        self._thread.daemon = True
        self._thread.start()
        log.info("admin port on %s:%d", self.address, self.port)
        return self.port

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def handle(self, request: AdminRequest) -> AdminResponse:
        """The route's answer; a 404/405, a ``BadRequest``'s status, or a 500 without
        details (logged) for anything else."""
        handler = self.routes.get((request.method, request.path))
        if handler is None:
            if any(path == request.path for _, path in self.routes):
                return AdminResponse.error(405, f"{request.method} is not allowed here")
            return AdminResponse.error(404, f"no such page: {request.path}; see /")
        try:
            return handler(request)
        except BadRequest as exc:
            return AdminResponse.error(exc.status, str(exc))
        except Exception:
            log.exception("admin: %s %s failed", request.method, request.path)
            return AdminResponse.error(500, "internal error (logged by extproc)")

    def _index(self, _request: AdminRequest) -> AdminResponse:
        """The routes, until the status page registers ``GET /`` (``admin.status_page``)."""
        routes = sorted(self.routes, key=lambda k: (k[1], k[0]))
        text = "extproc admin\n\n" + "".join(f"{m} {p}\n" for m, p in routes)
        return AdminResponse(200, text.encode(), "text/plain; charset=utf-8")

    def _pick(self, request: AdminRequest) -> AdminResponse:
        """``routing.explain.explain_pick``'s answer for the request described by the body:
        ``{"path", "headers", "body"}``, or the request body itself (an object with a
        ``model`` and no ``body``), its path in ``?path=`` and its headers the ``x-``
        headers sent here (``curl -d @body.json -H 'x-session-id: s' URL/debug/pick``)."""
        try:
            doc = json.loads(request.body or b"null")
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadRequest(f"the body is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise BadRequest(
                'expected a JSON object: {"path": ..., "headers": {...}, "body": {...}}, '
                "or the request body itself"
            )
        if "model" in doc and "body" not in doc:
            path = request.query.get("path", ["/v1/chat/completions"])[-1]
            headers = {k: v for k, v in request.headers.items() if k.startswith("x-")}
            raw = request.body
        else:
            path, headers, raw = _envelope(doc)
        if not isinstance(path, str) or not path.startswith("/"):
            raise BadRequest("'path' must be a request path such as /v1/chat/completions")
        answer = explain_pick(self.router, path, raw, headers)
        return AdminResponse.json(answer, int(answer.get("status", 200)))


def _envelope(doc: dict[str, Any]) -> tuple[Any, dict[str, str], bytes]:
    """``{"path", "headers", "body"}``: the path, the headers (lower-case), the body."""
    headers = doc.get("headers") or {}
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise BadRequest("'headers' must map header names to string values")
    body = doc.get("body")
    if body is None:
        raise BadRequest("'body' is required: the request body, as JSON or a string")
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    path = doc.get("path", "/v1/chat/completions")
    return path, {k.lower(): v for k, v in headers.items()}, raw


def _handler_class(server: AdminServer) -> type[BaseHTTPRequestHandler]:
    class _Handler(BaseHTTPRequestHandler):
        server_version = "extproc-admin"
        protocol_version = "HTTP/1.1"
        timeout = READ_TIMEOUT_S  # a client that stops sending frees its thread

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def _serve(self, method: str) -> None:
            try:
                response = self._respond(method)
            except Exception:  # never a traceback to the client
                log.exception("admin: %s %s failed", method, self.path)
                response = AdminResponse.error(500, "internal error (logged by extproc)")
            self.send_response(response.status)
            self.send_header("Content-Type", response.content_type)
            self.send_header("Content-Length", str(len(response.body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(response.body)

        def _respond(self, method: str) -> AdminResponse:
            url = urlsplit(self.path)
            length_text = self.headers.get("Content-Length") or "0"
            try:
                length = int(length_text)
            except ValueError:
                self.close_connection = True
                return AdminResponse.error(400, f"bad Content-Length: {length_text!r}")
            if length < 0 or length > server.max_body_bytes:
                self.close_connection = True
                return AdminResponse.error(
                    413, f"the body is over {server.max_body_bytes} bytes (--max-body-bytes)"
                )
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            request = AdminRequest(method, url.path, parse_qs(url.query), headers, body)
            return server.handle(request)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("admin: " + format, *args)

    return _Handler


def start_admin(
    args: argparse.Namespace,
    router: Router,
    config_source: str,
    store: PodStore | None = None,
    kv_events: KvEventsSubscriber | None = None,
) -> AdminServer | None:
    """The admin server of ``serve``'s flags, started; None with ``--admin-port 0``.

    Raises:
        ConfigError: the port is not a port number.
        OSError: it cannot be bound (the message names the address).
    """
    port = int(args.admin_port)
    if not 0 <= port <= 65535:
        raise ConfigError(f"--admin-port must be a port number from 0 (off) to 65535, got {port}")
    if not port:
        return None
    admin = AdminServer(
        router,
        args.admin_address,
        port,
        max_body_bytes=args.max_body_bytes,
        config_source=config_source,
        store=store,
        kv_events=kv_events,
    )
    admin.start()
    return admin
