"""Drive an ``Engine`` in real time on the running asyncio loop.

Engine time is seconds since the runner started (``loop.time()`` based). The loop task
runs a step as soon as there is work, sleeps until the step's end, then hands each
request its tokens. Each submitted request gets a ``RequestStream``: its tokens as they
are sampled, then the ``FinishedRequest``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from extproc.sim.engine import Engine, FinishedRequest, SimRequest, StepResult, TokenOutput

log = logging.getLogger(__name__)


class EngineStopped(Exception):
    """The runner stopped before the request finished."""


class RequestStream:
    """One request's tokens, in order; ``finished`` is set after the last one."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished: FinishedRequest | None = None
        self.num_cached_tokens: int | None = None  # known once admitted
        self._queue: asyncio.Queue[TokenOutput | FinishedRequest | EngineStopped] = asyncio.Queue()

    def _put(self, item: TokenOutput | FinishedRequest | EngineStopped) -> None:
        self._queue.put_nowait(item)

    async def tokens(self) -> AsyncIterator[TokenOutput]:
        """Yield tokens until the request finishes; then ``finished`` is set.

        Raises:
            EngineStopped: the runner stopped first.
        """
        while True:
            item = await self._queue.get()
            if isinstance(item, EngineStopped):
                raise item
            if isinstance(item, FinishedRequest):
                self.finished = item
                return
            yield item

    async def result(self) -> FinishedRequest:
        """Wait for the whole request."""
        async for _ in self.tokens():
            pass
        assert self.finished is not None
        return self.finished


class EngineRunner:
    """Real-time driver of one engine; ``on_step`` sees every step after its outputs."""

    def __init__(self, engine: Engine, on_step: Callable[[StepResult], None] | None = None) -> None:
        self.engine = engine
        self._on_step = on_step
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0

    def now(self) -> float:
        """Engine time: seconds since ``start``."""
        return asyncio.get_running_loop().time() - self._t0

    def start(self) -> None:
        self._t0 = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        """Stop stepping; every unfinished stream raises ``EngineStopped``."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._fail_all("the engine stopped")

    def submit(self, req: SimRequest) -> RequestStream:
        """Queue ``req`` now.

        Raises:
            EngineStopped: the runner is not running.
            RequestRejected, ValueError: as ``Engine.add_request``.
        """
        if self._task is None or self._task.done():
            raise EngineStopped("the engine is not running")
        self.engine.add_request(req, self.now())
        stream = RequestStream(req.request_id)
        self._streams[req.request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Forget a request (client gone, stream cut); its blocks are freed."""
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception:
            # A bug: never leave clients waiting on an engine that no longer steps.
            log.exception("the simulated engine failed")
            self._fail_all("the engine failed")

    def _fail_all(self, reason: str) -> None:
        for stream in self._streams.values():
            stream._put(EngineStopped(reason))
        self._streams.clear()

    async def _loop(self) -> None:
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            result = self.engine.step(self.now())
            for request_id, num_cached in result.admitted:
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.num_cached_tokens = num_cached
            # Always yield to the loop, even for a zero-length step.
            await asyncio.sleep(max(0.0, result.end_s - self.now()))
            for out in result.outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream._put(out)
            for fin in result.finished:
                stream = self._streams.pop(fin.request_id, None)
                if stream is not None:
                    stream._put(fin)
            if self._on_step is not None:
                self._on_step(result)
