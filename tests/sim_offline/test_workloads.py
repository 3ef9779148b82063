"""Synthetic workloads: text and tokens agree, prefixes are shared as designed, replays repeat."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

from extproc.request.parse import Api
from extproc.sim.engine import Engine, EngineConfig
from extproc.sim.tokenizer import tokenize
from extproc.sim.workloads import (
    BurstParams,
    ChatParams,
    Workload,
    burst_workload,
    chat_workload,
    multiturn_workload,
    tenants_workload,
    words_text,
)


def test_words_text_tokens_are_the_tokenizers() -> None:
    text, tokens = words_text(np.array([0, 5, 1444, 5, 17]))
    assert len(text.encode()) == 4 * 5
    assert list(tokens) == tokenize(text)


def test_burst_tenants_share_their_system_prompt_and_nothing_else() -> None:
    params = BurstParams(num_requests=60, system_tokens=64, user_tokens=(8, 16))
    items = list(burst_workload(params, seed=3).items())
    assert len(items) == 60
    assert [i.arrival_s for i in items] == sorted(i.arrival_s for i in items)
    systems = {i.sim.prompt_token_ids[:64] for i in items}
    assert len(systems) == params.num_tenants
    for item in items:
        assert item.request.api is Api.COMPLETIONS
        assert list(item.sim.prompt_token_ids) == tokenize(item.request.prompt)
        assert 64 + 8 <= len(item.sim.prompt_token_ids) <= 64 + 16


def test_burst_second_phase_is_mostly_one_tenant() -> None:
    params = BurstParams(num_requests=400)
    items = list(burst_workload(params).items())
    steady, burst = items[:200], items[200:]
    systems = Counter(i.sim.prompt_token_ids[: params.system_tokens] for i in burst)
    hot, num_hot = systems.most_common(1)[0]
    assert num_hot / len(burst) > 0.8  # 40/48 + 8/48 * 1/4 = 0.875
    num_hot_steady = sum(i.sim.prompt_token_ids[: params.system_tokens] == hot for i in steady)
    assert num_hot_steady / len(steady) < 0.4  # about 1/4
    assert burst[-1].arrival_s - burst[0].arrival_s < steady[-1].arrival_s - steady[0].arrival_s


@pytest.mark.parametrize("make", [burst_workload, chat_workload], ids=["burst", "chat"])
def test_same_seed_same_items_other_seed_other_items(make: Callable[..., Workload]) -> None:
    def digest(seed: int) -> list[tuple[float, str, tuple[int, ...]]]:
        return [
            (i.arrival_s, i.request.prompt, i.sim.prompt_token_ids) for i in make(seed=seed).items()
        ]

    assert digest(1) == digest(1)
    assert digest(1) != digest(2)


def test_chat_turn_extends_the_previous_prompt_with_the_engines_answer() -> None:
    params = ChatParams(num_requests=40, turns=(3, 3), system_tokens=32)
    items = {i.request_id: i for i in chat_workload(params, seed=5).items()}
    first, second = items["chat-0-0"], items["chat-0-1"]
    assert first.request.api is Api.CHAT_COMPLETIONS
    assert second.arrival_s > first.arrival_s
    assert second.request.prompt.startswith(first.request.prompt)
    engine = Engine(EngineConfig(block_size=4))
    engine.add_request(first.sim, 0.0)
    (answer,) = [fin for result in engine.advance_to(1e9) for fin in result.finished]
    previous = first.sim.prompt_token_ids + answer.output_token_ids
    assert second.sim.prompt_token_ids[: len(previous)] == previous
    engine.add_request(second.sim, engine.clock)
    ((_, num_cached),) = engine.step(engine.clock).admitted
    assert num_cached == (len(previous) - 1) // 4 * 4  # all but the unsaved last token's block


def test_multiturn_is_the_benchmarks_multiturn_shape() -> None:
    """bench.routing_quality's multiturn: 48 chats of 6 turns of 80-token questions, one
    200-token system prompt, on the benchmark's pods."""
    workload = multiturn_workload(seed=1)
    items = list(workload.items())
    assert (workload.name, len(items)) == ("multiturn", 288)
    chats = Counter(i.request_id.rsplit("-", 1)[0] for i in items)
    assert len(chats) == 48 and set(chats.values()) == {6}
    first_turns = [i.sim.prompt_token_ids for i in items if i.request_id.endswith("-0")]
    shared = min(len(os.path.commonprefix(first_turns)), 210)
    assert 200 <= shared < 210  # the system prompt and the chat template's few tokens
    assert {len(t) - shared for t in first_turns} <= set(range(80, 90))
    assert dict(workload.engine_defaults) == {"num_gpu_blocks": 2048, "max_num_seqs": 8}


def test_tenants_is_the_benchmarks_tenants_shape() -> None:
    """bench.routing_quality's tenants: 8 tenants' 600-token system prompts, 10 requests a
    second, then 500 requests at 5x the rate, 4 in 5 from one tenant."""
    workload = tenants_workload(seed=1)
    items = list(workload.items())
    assert (workload.name, len(items)) == ("tenants", 700)
    tenant = [i.sim.prompt_token_ids[:600] for i in items]
    assert len(set(tenant)) == 8
    assert all(10 <= len(i.sim.prompt_token_ids) - 600 <= 50 for i in items)
    steady, burst = items[:200], items[200:]
    _hot, num_hot = Counter(tenant[200:]).most_common(1)[0]
    assert num_hot / len(burst) > 0.75  # 0.8 + 0.2 / 8
    assert 15 < steady[-1].arrival_s < 25 and 8 < burst[-1].arrival_s - burst[0].arrival_s < 12
    assert dict(workload.engine_defaults) == {"num_gpu_blocks": 2048, "max_num_seqs": 8}
