"""Seeded synthetic workloads for the offline simulator: a multi-tenant burst and multi-turn chats.

A workload is a time-ordered stream of ``WorkItem``s. Each item carries both sides of one
request: the ``InferenceRequest`` the router parses from the JSON body a client would send
(``extproc.request.parse_request``, so the prefix-cache plugin hashes the real rendering)
and the ``SimRequest`` the engine runs (the same prompt as tokens).

Text. Prompts are made of the pseudo-tokenizer's 4-byte words (``tokenizer.WORDS``), so
every word is exactly one token and ``tokenize(text) == tokens``: text built word by word
gives its tokens without tokenizing (``words_text``).

Burst (the lab's scenario). ``num_tenants`` tenants each own a system prompt of
``system_tokens`` tokens; a request is a tenant's system prompt plus a fresh user part of
U ~ uniform[user_tokens] tokens and asks for O ~ uniform[output_tokens] tokens. Phase 1:
``num_requests * (1 - burst_share)`` requests, Poisson at ``steady_rate_per_s``, tenants
uniform. Phase 2: the rest, Poisson at ``steady_rate_per_s + burst_rate_per_s``; each is
tenant 0 with probability burst / (steady + burst), else a uniform tenant.

Chat. Conversations start Poisson at ``conversation_rate_per_s``; each picks one of
``num_system_prompts`` system prompts and has T ~ uniform[turns] turns. Turn k+1's prompt
is turn k's messages, the assistant's answer and a new user message, rendered in ChatML:
it extends turn k's prompt by the answer. The answer is the engine's own deterministic
output (``tokenizer.generate_words`` of the prompt tokens, seed 0), computed here, so the
workload is open loop: turn k+1 arrives ``O_k * nominal_itl_s`` (a nominal answer time)
plus an exponential think time (mean ``think_s``) after turn k arrived. Under overload it
can arrive before the answer ended; it still carries the same answer.

LoRA (``lora``). The ``multiturn`` chats, each conversation with one of ``num_adapters``
LoRA adapters (``lora-0`` ..., as ``launch.lora_args`` names them), drawn with Zipf
popularity (weight of the k-th: 1 / k^``zipf_s``), on engines of 2 GPU adapter slots.

``multiturn`` and ``tenants`` are chat and burst shaped like ``bench.routing_quality``'s
workloads of those names on its simulated pods (``bench/workloads.py``: sizes, rates,
think time), on its pods' engines (2,048 blocks, 8 running at most). Differences: the
answers in later turns are the engine's own output (4-32 tokens, not a fixed 40), chats
start Poisson rather than by a seeded ``random``, and the tenants' burst closes the run
instead of sitting in its middle third.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from extproc.request.parse import Api, InferenceRequest, parse_request
from extproc.sim.engine import SimRequest
from extproc.sim.lora import LoraRequest
from extproc.sim.tokenizer import WORDS, ChatMessage, generate_words, render_chat, word_token

DEFAULT_MODEL = "sim-llm"

WORD_BYTES: npt.NDArray[np.bytes_] = np.array([w.encode() for w in WORDS], dtype="S4")
WORD_TOKENS: npt.NDArray[np.int64] = np.array([word_token(w) for w in WORDS], dtype=np.int64)
NUM_WORDS = len(WORDS)


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request of a workload: when it arrives, what the router sees, what the engine runs."""

    arrival_s: float
    request: InferenceRequest
    sim: SimRequest

    @property
    def request_id(self) -> str:
        return self.sim.request_id


@dataclass(frozen=True, slots=True)
class Workload:
    """A replayable workload: ``items()`` yields a fresh stream in arrival order each call."""

    name: str
    params: Mapping[str, Any]  # everything needed to rebuild it, for the JSON report
    items: Callable[[], Iterator[WorkItem]]
    engine_defaults: Mapping[str, Any] = field(default_factory=dict)  # EngineConfig overrides


def words_text(word_idx: npt.NDArray[np.int64]) -> tuple[str, tuple[int, ...]]:
    """Text of the words ``WORDS[word_idx]`` and its tokens (one per word)."""
    return WORD_BYTES[word_idx].tobytes().decode("ascii"), tuple(WORD_TOKENS[word_idx].tolist())


def completion_item(
    request_id: str,
    arrival_s: float,
    text: str,
    tokens: tuple[int, ...],
    max_tokens: int,
    model: str,
) -> WorkItem:
    """A ``/v1/completions`` request for ``text`` (whose tokens are ``tokens``)."""
    request = InferenceRequest(Api.COMPLETIONS, model, text)
    return WorkItem(arrival_s, request, SimRequest(request_id, tokens, max_tokens))


@dataclass(frozen=True, slots=True)
class BurstParams:
    num_requests: int = 400
    num_tenants: int = 4
    system_tokens: int = 2048
    user_tokens: tuple[int, int] = (128, 512)
    output_tokens: tuple[int, int] = (16, 64)
    steady_rate_per_s: float = 8.0
    burst_rate_per_s: float = 40.0
    burst_share: float = 0.5


# A pod caches about two of the four 2048-token system prompts (128 blocks each) next to its
# running requests, so spreading every tenant over every pod thrashes the cache.
BURST_ENGINE_DEFAULTS: Mapping[str, Any] = {"num_gpu_blocks": 384}


def burst_workload(
    params: BurstParams = BurstParams(), seed: int = 0, model: str = DEFAULT_MODEL
) -> Workload:
    """The multi-tenant burst (module docstring)."""

    def items() -> Iterator[WorkItem]:
        rng = np.random.default_rng(seed)
        systems = [
            rng.integers(0, NUM_WORDS, params.system_tokens) for _ in range(params.num_tenants)
        ]
        num_burst = round(params.num_requests * params.burst_share)
        num_steady = params.num_requests - num_burst
        burst_total = params.steady_rate_per_s + params.burst_rate_per_s
        p_burst = params.burst_rate_per_s / burst_total
        now = 0.0
        for idx in range(params.num_requests):
            if idx < num_steady:
                now += rng.exponential(1.0 / params.steady_rate_per_s)
                tenant = int(rng.integers(params.num_tenants))
            else:
                now += rng.exponential(1.0 / burst_total)
                in_burst = rng.random() < p_burst
                tenant = 0 if in_burst else int(rng.integers(params.num_tenants))
            user = rng.integers(0, NUM_WORDS, _uniform(rng, params.user_tokens))
            text, tokens = words_text(np.concatenate([systems[tenant], user]))
            max_tokens = _uniform(rng, params.output_tokens)
            yield completion_item(f"burst-{idx}", now, text, tokens, max_tokens, model)

    return Workload(
        "burst", {"seed": seed, "model": model, **asdict(params)}, items, BURST_ENGINE_DEFAULTS
    )


@dataclass(frozen=True, slots=True)
class ChatParams:
    num_requests: int = 300
    num_system_prompts: int = 2
    system_tokens: int = 512
    turns: tuple[int, int] = (2, 8)
    user_tokens: tuple[int, int] = (32, 256)
    output_tokens: tuple[int, int] = (32, 256)
    conversation_rate_per_s: float = 1.0
    think_s: float = 10.0
    nominal_itl_s: float = 0.02


# 1024 blocks = 16,384 tokens a pod: a few dozen conversations, fewer than the workload has.
CHAT_ENGINE_DEFAULTS: Mapping[str, Any] = {"num_gpu_blocks": 1024}


def chat_workload(
    params: ChatParams = ChatParams(), seed: int = 0, model: str = DEFAULT_MODEL
) -> Workload:
    """Multi-turn chats (module docstring); the first ``num_requests`` turns by arrival."""

    def items() -> Iterator[WorkItem]:
        rng = np.random.default_rng(seed)
        systems = [
            words_text(rng.integers(0, NUM_WORDS, params.system_tokens))[0]
            for _ in range(params.num_system_prompts)
        ]
        mean_turns = (params.turns[0] + params.turns[1]) / 2
        num_conversations = max(1, math.ceil(params.num_requests / mean_turns))
        turns: list[tuple[float, int, int, list[ChatMessage], int]] = []
        start = 0.0
        for conv in range(num_conversations):
            start += rng.exponential(1.0 / params.conversation_rate_per_s)
            messages = [ChatMessage("system", systems[int(rng.integers(len(systems)))])]
            now = start
            for turn in range(_uniform(rng, params.turns)):
                user = words_text(rng.integers(0, NUM_WORDS, _uniform(rng, params.user_tokens)))
                messages = [*messages, ChatMessage("user", user[0])]
                max_tokens = _uniform(rng, params.output_tokens)
                turns.append((now, conv, turn, messages, max_tokens))
                answer = "".join(generate_words(render_chat(messages), max_tokens))
                messages = [*messages, ChatMessage("assistant", answer)]
                now += max_tokens * params.nominal_itl_s + rng.exponential(params.think_s)
        turns.sort(key=lambda t: (t[0], t[1]))
        for arrival_s, conv, turn, messages, max_tokens in turns[: params.num_requests]:
            yield chat_item(f"chat-{conv}-{turn}", arrival_s, messages, max_tokens, model)

    return Workload(
        "chat", {"seed": seed, "model": model, **asdict(params)}, items, CHAT_ENGINE_DEFAULTS
    )


def chat_item(
    request_id: str, arrival_s: float, messages: list[ChatMessage], max_tokens: int, model: str
) -> WorkItem:
    """A ``/v1/chat/completions`` request, parsed by the router's own request parser."""
    body = {
        "model": model,
        "messages": [{"role": m.role, "content": m.content} for m in messages],
        "max_tokens": max_tokens,
    }
    request = parse_request(Api.CHAT_COMPLETIONS.value, orjson.dumps(body))
    tokens = tuple(render_chat(messages))
    return WorkItem(arrival_s, request, SimRequest(request_id, tokens, max_tokens))


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    """An integer uniform in [low, high], both included."""
    return int(rng.integers(bounds[0], bounds[1] + 1))


# The benchmark's simulated pods (bench.routing_quality: sim-pods --num-gpu-blocks 2048
# --max-num-seqs 8): a pod holds 32,768 tokens.
BENCH_ENGINE_DEFAULTS: Mapping[str, Any] = {"num_gpu_blocks": 2048, "max_num_seqs": 8}

# bench multiturn: 48 chats of 6 turns (user 80 tokens), one 200-token system prompt,
# 4 chats a second, 2 s think time.
MULTITURN_PARAMS = ChatParams(
    num_requests=288,
    num_system_prompts=1,
    system_tokens=200,
    turns=(6, 6),
    user_tokens=(80, 80),
    output_tokens=(4, 32),
    conversation_rate_per_s=4.0,
    think_s=2.0,
    nominal_itl_s=0.01,
)

# bench tenants: 8 tenants with 600-token system prompts, questions of 40-200 bytes,
# 10 requests a second, then 10 s of 5x the rate, 4 in 5 of them from tenant 0.
TENANTS_PARAMS = BurstParams(
    num_requests=700,
    num_tenants=8,
    system_tokens=600,
    user_tokens=(10, 50),
    output_tokens=(4, 32),
    steady_rate_per_s=10.0,
    burst_rate_per_s=40.0,
    burst_share=500 / 700,
)


def multiturn_workload(
    seed: int = 0, model: str = DEFAULT_MODEL, num_requests: int | None = None
) -> Workload:
    """Chat shaped like the benchmark's ``multiturn`` (module docstring)."""
    params = replace(MULTITURN_PARAMS, num_requests=num_requests or MULTITURN_PARAMS.num_requests)
    workload = chat_workload(params, seed, model)
    return replace(workload, name="multiturn", engine_defaults=BENCH_ENGINE_DEFAULTS)


def tenants_workload(
    seed: int = 0, model: str = DEFAULT_MODEL, num_requests: int | None = None
) -> Workload:
    """Burst shaped like the benchmark's ``tenants`` (module docstring)."""
    params = replace(TENANTS_PARAMS, num_requests=num_requests or TENANTS_PARAMS.num_requests)
    workload = burst_workload(params, seed, model)
    return replace(workload, name="tenants", engine_defaults=BENCH_ENGINE_DEFAULTS)


@dataclass(frozen=True, slots=True)
class GroupsParams:
    """Groups of chat sessions sharing a short system prompt, every session's history
    growing each round, sent at a fixed rate (``groups_workload``)."""

    num_groups: int = 13
    sessions_per_group: int = 5
    system_tokens: int = 300
    user_tokens: tuple[int, int] = (250, 350)
    output_tokens: tuple[int, int] = (16, 32)
    rate_per_s: float = 12.0
    num_requests: int = 720


def groups_workload(
    params: GroupsParams = GroupsParams(), seed: int = 0, model: str = DEFAULT_MODEL
) -> Workload:
    """Sessions in groups (module docstring): request ``k`` arrives at ``k / rate`` and is
    the next round of session ``order[k mod sessions]`` (a seeded order), whose prompt is
    its whole history (its group's system prompt, earlier rounds and answers) plus a new
    user message."""

    def items() -> Iterator[WorkItem]:
        rng = np.random.default_rng(seed)
        systems = [
            words_text(rng.integers(0, NUM_WORDS, params.system_tokens))[0]
            for _ in range(params.num_groups)
        ]
        num_sessions = params.num_groups * params.sessions_per_group
        order = rng.permutation(num_sessions)
        histories = [
            [ChatMessage("system", systems[s // params.sessions_per_group])]
            for s in range(num_sessions)
        ]
        for k in range(params.num_requests):
            session = int(order[k % num_sessions])
            user = words_text(rng.integers(0, NUM_WORDS, _uniform(rng, params.user_tokens)))
            messages = [*histories[session], ChatMessage("user", user[0])]
            max_tokens = _uniform(rng, params.output_tokens)
            answer = "".join(generate_words(render_chat(messages), max_tokens))
            histories[session] = [*messages, ChatMessage("assistant", answer)]
            round_ = k // num_sessions
            yield chat_item(
                f"groups-{session}-{round_}", k / params.rate_per_s, messages, max_tokens, model
            )

    return Workload(
        "groups", {"seed": seed, "model": model, **asdict(params)}, items, BENCH_ENGINE_DEFAULTS
    )


@dataclass(frozen=True, slots=True)
class LoraParams:
    num_adapters: int = 16
    zipf_s: float = 1.1
    chat: ChatParams = MULTITURN_PARAMS


LORA_ENGINE_DEFAULTS: Mapping[str, Any] = {
    **BENCH_ENGINE_DEFAULTS,
    "enable_lora": True,
    "max_loras": 2,
}


def lora_adapters(num_adapters: int) -> tuple[LoraRequest, ...]:
    """``lora-0`` .. with ids from 1, at the paths ``launch.lora_args`` gives them."""
    return tuple(
        LoraRequest(f"lora-{i}", i + 1, f"/sim/adapters/lora-{i}") for i in range(num_adapters)
    )


def lora_workload(
    params: LoraParams = LoraParams(), seed: int = 0, model: str = DEFAULT_MODEL
) -> Workload:
    """Chats on LoRA adapters (module docstring); ``params["adapters"]`` names them, for
    the pods to serve."""
    chat = chat_workload(params.chat, seed, model)
    adapters = lora_adapters(params.num_adapters)
    weights = 1.0 / np.arange(1, params.num_adapters + 1) ** params.zipf_s
    weights /= weights.sum()

    def items() -> Iterator[WorkItem]:
        rng = np.random.default_rng([seed, 1])
        of_conversation: dict[str, LoraRequest] = {}
        for item in chat.items():
            conversation = item.request_id.rsplit("-", 1)[0]
            if conversation not in of_conversation:
                of_conversation[conversation] = adapters[rng.choice(len(adapters), p=weights)]
            adapter = of_conversation[conversation]
            yield WorkItem(
                item.arrival_s,
                replace(item.request, model=adapter.name),
                replace(item.sim, lora=adapter),
            )

    info = {"seed": seed, "model": model, "num_adapters": params.num_adapters,
            "zipf_s": params.zipf_s, "adapters": [a.name for a in adapters],
            **asdict(params.chat)}  # fmt: skip
    return Workload("lora", info, items, LORA_ENGINE_DEFAULTS)
