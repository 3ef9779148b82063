"""Open-loop replay of timed requests against one URL, streamed, bounded in count and time.

Each request is sent at its arrival time (whatever is still in flight), with
``"stream": true`` and usage in the last chunk, so the client sees the time to first
token (first chunk carrying text) and the end. At most ``max_in_flight`` requests are
open at once; past ``deadline_s`` nothing new starts and open requests are cancelled.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from bench.envoy_timings import REQUEST_HEADER
from bench.workloads import TimedRequest


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    ttft_s: float | None
    e2e_s: float
    completion_tokens: int
    error: str = ""
    at_s: float = 0.0  # when it was due, from the start of the replay
    session: int | None = None  # the request's chat (``TimedRequest.session``)
    prompt_tokens: int | None = None  # from the usage chunk, when the server sent one
    cached_tokens: int | None = None  # usage's prompt_tokens_details, when the server sent it
    index: int | None = None  # the request's place in the replayed list (``REQUEST_HEADER``)


def _has_text(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def _one(client: httpx.AsyncClient, req: TimedRequest, index: int | None = None) -> Outcome:
    body = {**req.body, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"content-type": "application/json"}
    if index is not None:
        headers[REQUEST_HEADER] = str(index)
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    done = False
    try:
        async with client.stream("POST", req.path, content=orjson.dumps(body),
                                 headers=headers) as resp:  # fmt: skip
            if resp.status_code != 200:
                await resp.aread()
                return _outcome(req, False, None, start, {}, f"http {resp.status_code}", index)
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = orjson.loads(data)
                if ttft is None and _has_text(chunk):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (httpx.HTTPError, orjson.JSONDecodeError) as e:
        return _outcome(req, False, ttft, start, usage, type(e).__name__, index)
    return _outcome(req, done, ttft, start, usage, "" if done else "no [DONE]", index)


def _outcome(
    req: TimedRequest,
    ok: bool,
    ttft: float | None,
    start: float,
    usage: dict[str, Any],
    error: str,
    index: int | None,
) -> Outcome:
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        ok, ttft, time.perf_counter() - start, usage.get("completion_tokens", 0), error,
        req.at_s, req.session, usage.get("prompt_tokens"), details.get("cached_tokens"), index,
    )  # fmt: skip


async def replay(
    url: str, requests: list[TimedRequest], *, max_in_flight: int = 256, deadline_s: float = 120.0
) -> tuple[list[Outcome], float]:
    """Send every request at its time; returns the outcomes and the wall time taken."""
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    timeout = httpx.Timeout(deadline_s, connect=10.0)
    gate = asyncio.Semaphore(max_in_flight)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        start = time.perf_counter()

        async def launch(index: int, req: TimedRequest) -> Outcome:
            await asyncio.sleep(max(0.0, req.at_s - (time.perf_counter() - start)))
            async with gate:
                return await _one(client, req, index)

        tasks = [asyncio.create_task(launch(i, r)) for i, r in enumerate(requests)]
        finished, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - start
    outcomes = [t.result() for t in tasks if t in finished]
    outcomes += [Outcome(False, None, wall, 0, "deadline")] * len(pending)
    return outcomes, wall
