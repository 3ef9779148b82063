"""Factories shared by the sim tests, like vLLM's make_request."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from extproc.sim.engine import Engine, FinishedRequest, SimRequest

_ids = itertools.count()


def seq(seed: int, n: int) -> list[int]:
    """n deterministic token ids from a seed, as in vllm-prefix-caching.txt's Go code."""
    return [(seed * 7919 + i * 104729) % 50000 for i in range(n)]


def make_request(
    prompt: Sequence[int], max_tokens: int = 1, salt: str | None = None, request_id: str = ""
) -> SimRequest:
    return SimRequest(request_id or f"r{next(_ids)}", tuple(prompt), max_tokens, salt)


def run_alone(engine: Engine, req: SimRequest) -> FinishedRequest:
    """Add ``req`` at the engine's clock and step until it finishes."""
    engine.add_request(req, engine.clock)
    while True:
        result = engine.step(engine.clock)
        for fin in result.finished:
            if fin.request_id == req.request_id:
                return fin
