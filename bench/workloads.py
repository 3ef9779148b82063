"""Benchmark workloads as timed requests: Mooncake traces, multi-tenant burst, multi-turn
chats, groups of chat sessions.

Every workload is a list of ``TimedRequest`` (arrival time, API path, JSON body, and the
prompt text the prefix bound is computed on), deterministic for a seed.

Mooncake (``../shared/traces/``): each ``hash_id`` stands for one 512-token block; it is
turned into a fixed block of pseudo-random words (seeded by the id, ``4 * 512 / scale``
bytes, so about 4 bytes a token), a request's blocks are concatenated and cut to
``input_length / scale`` tokens. Requests then share text exactly as far as their
``hash_ids`` share a prefix; ``output_length / scale`` (clamped) becomes ``max_tokens``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

from extproc.sim.traces import default_trace_dir

BYTES_PER_TOKEN = 4
MOONCAKE_BLOCK_TOKENS = 512
TRACES_DIR = default_trace_dir()  # <repo>/../shared/traces, one definition
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvz" for v in "aeiou"]


@dataclass(frozen=True, slots=True)
class TimedRequest:
    at_s: float  # arrival, seconds from the start
    path: str
    body: dict[str, Any]
    prompt: str  # the text whose prefix sharing bounds the hit ratio
    session: int | None = None  # a chat's number (its turns re-send its history), else None


@dataclass(frozen=True, slots=True)
class Sizing:
    """How big the serving side is: prompts and outputs are scaled and clamped to it."""

    scale: int = 16  # divide trace token counts by this
    max_prompt_tokens: int = 8000
    max_output_tokens: int = 32
    model: str = "sim-llm"


def words(seed: int, num_bytes: int) -> str:
    """Deterministic pseudo-random words, exactly ``num_bytes`` ASCII bytes."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < num_bytes:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) + " "
        out.append(word)
        size += len(word)
    return "".join(out)[:num_bytes]


def _trace_lines(path: Path, limit: int) -> Iterator[dict[str, Any]]:
    with path.open() as f:
        for line in islice(f, limit):
            yield json.loads(line)


def mooncake(name: str, sizing: Sizing, limit: int, speedup: float) -> list[TimedRequest]:
    """The first ``limit`` requests of ``mooncake_{name}_trace.jsonl``, clock ``speedup`` x."""
    block_bytes = BYTES_PER_TOKEN * MOONCAKE_BLOCK_TOKENS // sizing.scale
    blocks: dict[int, str] = {}
    out = []
    for rec in _trace_lines(TRACES_DIR / f"mooncake_{name}_trace.jsonl", limit):
        text = "".join(blocks.setdefault(h, words(h, block_bytes)) for h in rec["hash_ids"])
        tokens = min(max(rec["input_length"] // sizing.scale, 1), sizing.max_prompt_tokens)
        prompt = text[: tokens * BYTES_PER_TOKEN]
        max_tokens = min(max(rec["output_length"] // sizing.scale, 1), sizing.max_output_tokens)
        body = {"model": sizing.model, "prompt": prompt, "max_tokens": max_tokens}
        out.append(TimedRequest(rec["timestamp"] / 1000 / speedup, "/v1/completions", body, prompt))
    return out


def chatml(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _chat(
    sizing: Sizing,
    at_s: float,
    messages: list[dict[str, str]],
    out: int,
    session: int | None = None,
) -> TimedRequest:
    body = {"model": sizing.model, "messages": messages, "max_tokens": out}
    return TimedRequest(at_s, "/v1/chat/completions", body, chatml(messages), session)


def multi_tenant_burst(
    sizing: Sizing,
    *,
    tenants: int = 8,
    rate: float = 20.0,
    seconds: float = 30.0,
    burst_tenant: int = 0,
    burst_factor: float = 6.0,
    system_tokens: int = 600,
    seed: int = 1,
) -> list[TimedRequest]:
    """Tenants with long system prompts, Poisson arrivals; in the middle third, tenant
    ``burst_tenant`` sends ``burst_factor`` times the whole base rate on its own."""
    rng = random.Random(seed)
    systems = [words(10_000 + t, system_tokens * BYTES_PER_TOKEN) for t in range(tenants)]
    out, t = [], 0.0
    while t < seconds:
        in_burst = seconds / 3 <= t < 2 * seconds / 3
        total = rate * (1 + burst_factor) if in_burst else rate
        t += rng.expovariate(total)
        tenant = (
            burst_tenant
            if in_burst and rng.random() < burst_factor / (1 + burst_factor)
            else rng.randrange(tenants)
        )
        question = words(rng.randrange(1 << 30), rng.randint(40, 200))
        messages = [
            {"role": "system", "content": systems[tenant]},
            {"role": "user", "content": question},
        ]
        out.append(_chat(sizing, t, messages, rng.randint(4, sizing.max_output_tokens)))
    return out


def multi_turn(
    sizing: Sizing,
    *,
    sessions: int = 48,
    turns: int = 6,
    rate: float = 4.0,
    think_s: float = 2.0,
    turn_tokens: int = 80,
    system_tokens: int = 200,
    seed: int = 2,
) -> list[TimedRequest]:
    """Chat sessions starting at ``rate`` per second; each turn re-sends the whole history
    (a short shared system prompt, earlier questions and fixed assistant answers)."""
    system = words(7, system_tokens * BYTES_PER_TOKEN)
    return _chats(
        random.Random(seed), lambda _rng: (sizing, system), sessions=sessions, turns=turns,
        rate=rate, think_s=think_s, turn_tokens=turn_tokens, words_seed=0,
    )  # fmt: skip


def adapter_names(num_adapters: int) -> list[str]:
    """The LoRA adapters the ``lora`` workload's requests name (the pods register them)."""
    return [f"lora-{k}" for k in range(num_adapters)]


def lora_sessions(
    sizing: Sizing,
    *,
    adapters: int = 16,
    zipf_s: float = 1.0,
    sessions: int = 64,
    turns: int = 4,
    rate: float = 4.0,
    think_s: float = 2.0,
    turn_tokens: int = 80,
    system_tokens: int = 200,
    seed: int = 6,
) -> list[TimedRequest]:
    """Multi-turn chats, each for one LoRA adapter (its ``model``), adapters chosen with
    Zipf popularity (``zipf_s``): a few adapters busy, a long tail seldom asked for. Each
    adapter's chats share its own system prompt; each turn re-sends the history."""
    names = adapter_names(adapters)
    weights = [1 / (k + 1) ** zipf_s for k in range(adapters)]
    systems = [words(30_000 + k, system_tokens * BYTES_PER_TOKEN) for k in range(adapters)]

    def opening(rng: random.Random) -> tuple[Sizing, str]:
        (adapter,) = rng.choices(range(adapters), weights)
        return replace(sizing, model=names[adapter]), systems[adapter]

    return _chats(
        random.Random(seed), opening, sessions=sessions, turns=turns, rate=rate,
        think_s=think_s, turn_tokens=turn_tokens, words_seed=40_000,
    )  # fmt: skip


def _chats(
    rng: random.Random,
    opening: Callable[[random.Random], tuple[Sizing, str]],
    *,
    sessions: int,
    turns: int,
    rate: float,
    think_s: float,
    turn_tokens: int,
    words_seed: int,
) -> list[TimedRequest]:
    """Chats starting at ``rate`` per second, each opened by ``opening`` (its sizing, with
    the model, and its system prompt); each turn re-sends the history with a new question
    (words seeded from ``words_seed``) and a fixed answer, after a think time."""
    out: list[TimedRequest] = []
    start = 0.0
    for s in range(sessions):
        start += rng.expovariate(rate)
        sizing, system = opening(rng)
        messages = [{"role": "system", "content": system}]
        at = start
        for turn in range(turns):
            seed_s = words_seed + s * 1000 + turn
            messages = [
                *messages,
                {"role": "user", "content": words(seed_s, turn_tokens * BYTES_PER_TOKEN)},
            ]
            max_tokens = rng.randint(4, sizing.max_output_tokens)
            out.append(_chat(sizing, at, messages, max_tokens, session=s))
            answer = words(seed_s + 500, turn_tokens * BYTES_PER_TOKEN // 2)
            messages = [*messages, {"role": "assistant", "content": answer}]
            at += rng.expovariate(1 / think_s)
    return sorted(out, key=lambda r: r.at_s)


def group_sessions(
    sizing: Sizing,
    *,
    groups: int = 13,
    sessions_per_group: int = 5,
    system_tokens: int = 300,
    user_tokens: tuple[int, int] = (250, 350),
    answer_tokens: int = 32,
    rate: float = 20.0,
    requests: int = 1000,
    seed: int = 3,
) -> list[TimedRequest]:
    """Groups of chat sessions (issue 35; ``extproc/sim/workloads.py::groups_workload`` for
    the offline simulator): each group's sessions share a short system prompt of its own,
    and every session's history grows each round by a user message of uniform
    ``user_tokens`` and a fixed answer (about 330 tokens a round, some 15 rounds with the
    defaults). Request ``k`` arrives at ``k / rate`` (a fixed rate, open loop, near what
    the pods serve only when the load is spread) and is the next round of session
    ``order[k mod sessions]`` (a seeded order). On the 8 simulated pods (32,768 tokens of
    cache each) a group's 5 histories reach about 28,000 tokens: two groups piled on one
    pod outgrow its cache past mid-run, while the 65 histories spread over all pods just
    about fit (about 190,000 tokens at mid-run, 360,000 at the end, of 262,144). A history
    that would exceed ``sizing.max_prompt_tokens`` starts over (its system prompt and the
    new message) under a new session number, so that no prompt outgrows the pods and
    ``routing_quality.lost_histories`` does not count the restart as a lost history."""
    rng = random.Random(seed)
    systems = [words(20_000 + g, system_tokens * BYTES_PER_TOKEN) for g in range(groups)]
    num_sessions = groups * sessions_per_group
    order = rng.sample(range(num_sessions), num_sessions)
    histories = [[{"role": "system", "content": systems[s // sessions_per_group]}]
                 for s in range(num_sessions)]  # fmt: skip
    numbers = list(range(num_sessions))  # each session's current number (restarts renumber)
    restarts = 0
    out: list[TimedRequest] = []
    for k in range(requests):
        s = order[k % num_sessions]
        question = words(rng.randrange(1 << 30), rng.randint(*user_tokens) * BYTES_PER_TOKEN)
        messages = [*histories[s], {"role": "user", "content": question}]
        if len(chatml(messages)) > sizing.max_prompt_tokens * BYTES_PER_TOKEN:
            messages = [histories[s][0], messages[-1]]
            numbers[s] = num_sessions + restarts
            restarts += 1
        max_tokens = rng.randint(4, sizing.max_output_tokens)
        out.append(_chat(sizing, k / rate, messages, max_tokens, session=numbers[s]))
        answer = words(rng.randrange(1 << 30), answer_tokens * BYTES_PER_TOKEN)
        histories[s] = [*messages, {"role": "assistant", "content": answer}]
    return out


def prefix_bound(requests: list[TimedRequest], block_bytes: int) -> float:
    """Hit ratio with unlimited cache and perfect routing: per request, the longest prefix
    (in whole blocks of ``block_bytes``) shared with any earlier request, over all bytes."""
    seen: set[int] = set()
    hit = total = 0
    for r in sorted(requests, key=lambda r: r.at_s):
        text = r.prompt.encode()
        chain, matching = 0, True
        for i in range(len(text) // block_bytes):
            chain = hash((chain, text[i * block_bytes : (i + 1) * block_bytes]))
            matching = matching and chain in seen
            hit += block_bytes if matching else 0
            seen.add(chain)
        total += len(text)
    return hit / total if total else 0.0
