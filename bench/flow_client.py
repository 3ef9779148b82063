"""bench.flow_control's client: open-loop replay with the class headers, and the pods'
capacity measured closed loop.

Every request streams (usage in the last chunk) so the client sees its time to first
token; a refusal is kept with its status and ``Retry-After``. Open loop: each request is
sent at its arrival time whatever is still open; past ``deadline_s`` nothing new starts
and open requests are cancelled (counted as ``deadline``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from bench.flow_workload import PATH, FlowRequest, Mix, body

MAX_IN_FLIGHT = 4096  # open loop: bounded only so a broken router cannot exhaust the client
CAPACITY_SEED = 10**12  # the capacity run's prompts share none with the schedules'


@dataclass(frozen=True, slots=True)
class FlowOutcome:
    cls: str
    tenant: str
    at_s: float  # when it was due
    status: int  # HTTP status; 0: no response (connection error, deadline)
    ttft_s: float | None
    e2e_s: float
    completion_tokens: int
    retry_after: str | None = None
    error: str = ""  # empty when served whole

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def end_s(self) -> float:
        """When it ended, from the start of the replay."""
        return self.at_s + self.e2e_s


def _has_text(chunk: dict[str, Any]) -> bool:
    return any(c.get("text") for c in chunk.get("choices") or ())


async def send(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], headers: dict[str, str]
) -> tuple[int, float | None, int, str | None, str]:
    """One streamed request: status, TTFT, completion tokens, Retry-After, error."""
    data = orjson.dumps({**payload, "stream": True, "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    ttft: float | None = None
    tokens, done = 0, False
    try:
        async with client.stream("POST", url + PATH, content=data,
                                 headers={"content-type": "application/json", **headers}) as resp:  # fmt: skip
            if resp.status_code != 200:
                await resp.aread()
                error = f"http {resp.status_code}"
                return resp.status_code, None, 0, resp.headers.get("retry-after"), error
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = orjson.loads(line[6:])
                if ttft is None and _has_text(chunk):
                    ttft = time.perf_counter() - start
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    except (httpx.HTTPError, orjson.JSONDecodeError) as e:
        return 200 if ttft is not None else 0, ttft, tokens, None, type(e).__name__
    return 200, ttft, tokens, None, "" if done else "no [DONE]"


async def replay(
    url: str, requests: Sequence[FlowRequest], *, deadline_s: float
) -> list[FlowOutcome]:
    """Send every request at its time, with its class headers; one outcome each."""
    limits = httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(deadline_s, connect=10)) as c:
        start = time.perf_counter()

        async def launch(req: FlowRequest) -> FlowOutcome:
            await asyncio.sleep(max(0.0, req.at_s - (time.perf_counter() - start)))
            sent = time.perf_counter()
            status, ttft, tokens, retry, error = await send(c, url, req.body, req.headers)
            e2e = time.perf_counter() - sent
            return FlowOutcome(req.cls, req.tenant, req.at_s, status, ttft, e2e, tokens, retry,
                               error)  # fmt: skip

        tasks = [asyncio.create_task(launch(r)) for r in requests]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [
        t.result() if t not in pending else FlowOutcome(r.cls, r.tenant, r.at_s, 0, None,
                                                        deadline_s, 0, None, "deadline")
        for t, r in zip(tasks, requests, strict=True)
    ]  # fmt: skip


async def capacity(
    pod_urls: Sequence[str], mix: Mix, *, concurrency: int, seconds: float, warmup_s: float
) -> float:
    """Requests a second the pods complete when kept full: ``concurrency`` closed-loop
    workers, worker i sending to pod i mod the pods (no router), counted after
    ``warmup_s`` (the queues filling) until ``seconds``."""
    done: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(seconds + 30)) as client:
        start = time.perf_counter()

        async def worker(i: int) -> None:
            n = 0
            while time.perf_counter() - start < seconds:
                payload = body(mix, seed=CAPACITY_SEED + i * 1_000_003 + n)
                n += 1
                status, _, _, _, error = await send(
                    client, pod_urls[i % len(pod_urls)], payload, {}
                )
                if status == 200 and not error:
                    done.append(time.perf_counter() - start)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    counted = [t for t in done if warmup_s <= t <= seconds]
    return len(counted) / (seconds - warmup_s)
