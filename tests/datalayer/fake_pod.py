"""A fake pod's ``/metrics`` on 127.0.0.1: a real aiohttp server in its own thread.

``mode`` switches what it answers: ``ok`` (``page``), ``error`` (HTTP 500), ``garbage``
(a 200 HTML page), ``malformed`` (a broken wanted line) or ``slow`` (``page`` after
``delay_s``); ``down()`` closes the listener and every connection, ``up()`` listens on
the same port again. Like vLLM, ``/metrics/?name[]=N`` answers only the samples named N
(``/metrics`` ignores the parameter); with ``filters=False`` there is no ``/metrics/``
(404), as on an engine that serves its page only at ``/metrics``. ``paths`` lists the
paths with query asked for. ``page_at_next_scrape(P)`` serves ``P`` from the next
``/metrics/`` request on: a scrape starts there, so no scrape reads two pages.
``/v1/models`` answers ``models_page`` with status ``models_status`` (vLLM's OpenAI
model list: ``models_list`` writes one).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Literal

from aiohttp import web

Mode = Literal["ok", "error", "garbage", "malformed", "slow"]


class FakePod:
    def __init__(self, page: str, *, delay_s: float = 2.0, filters: bool = True) -> None:
        self.page = page
        self.filters = filters
        self.paths: list[str] = []
        self.mode: Mode = "ok"
        self.delay_s = delay_s
        self.num_requests = 0
        self._next_page: str | None = None
        self.models_page = models_list()
        self.models_status = 200
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FakePod:
        self._thread.start()
        self.up()
        return self

    def page_at_next_scrape(self, page: str) -> None:
        self._next_page = page

    def up(self) -> None:
        self._call(self._up())

    def down(self) -> None:
        self._call(self._down())

    def stop(self) -> None:
        self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._loop.close()

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(5.0)  # type: ignore[arg-type]

    async def _up(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/metrics/", self._metrics)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _down(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        self.num_requests += 1
        self.paths.append(request.path_qs)
        if request.path == "/metrics/" and self._next_page is not None:
            self.page, self._next_page = self._next_page, None
        if request.path == "/metrics/" and not self.filters:
            raise web.HTTPNotFound()
        if self.mode == "error":
            return web.Response(status=500, text="engine dead")
        if self.mode == "garbage":
            return web.Response(text="<html>hello</html>", content_type="text/html")
        if self.mode == "malformed":
            return web.Response(text='vllm:num_requests_waiting{engine="0" 1\n')
        if self.mode == "slow":
            await asyncio.sleep(self.delay_s)
        names = request.query.getall("name[]", [])
        if request.path != "/metrics/" or not names:
            return web.Response(text=self.page)
        wanted = set(names)
        lines = [line for line in self.page.splitlines() if _sample_name(line) in wanted]
        return web.Response(text="".join(f"{line}\n" for line in lines))

    async def _models(self, request: web.Request) -> web.Response:
        self.paths.append(request.path_qs)
        return web.Response(
            text=self.models_page, status=self.models_status, content_type="application/json"
        )


def models_list(*entries: tuple[str, str | None]) -> str:
    """vLLM's ``/v1/models`` body listing ``(id, parent)`` entries."""
    data = [
        {"id": i, "object": "model", "owned_by": "vllm", "root": f"/m/{i}", "parent": parent}
        for i, parent in entries
    ]
    return json.dumps({"object": "list", "data": data})


def _sample_name(line: str) -> str:
    """A sample line's metric name ("" for comments and blank lines)."""
    if line.startswith("#"):
        return ""
    return line.split("{", 1)[0].split(" ", 1)[0]
