"""bench.workloads.group_sessions (issue 35): groups of chat sessions sharing a system
prompt per group, histories growing every round, requests at a fixed rate."""

from __future__ import annotations

import argparse
from collections import defaultdict
from itertools import pairwise

import pytest

from bench.routing_quality import WORKLOADS, build_workload
from bench.workloads import BYTES_PER_TOKEN, Sizing, TimedRequest, group_sessions

SIZING = Sizing()


def small(sizing: Sizing = SIZING, seed: int = 3) -> list[TimedRequest]:
    """3 groups of 2 sessions, 5 rounds each at 4 requests a second."""
    return group_sessions(sizing, groups=3, sessions_per_group=2, system_tokens=30,
                          user_tokens=(10, 20), rate=4.0, requests=30, seed=seed)  # fmt: skip


def by_session(requests: list[TimedRequest]) -> dict[int, list[TimedRequest]]:
    out: dict[int, list[TimedRequest]] = defaultdict(list)
    for r in requests:
        assert r.session is not None
        out[r.session].append(r)
    return out


def test_the_same_seed_gives_the_same_requests_and_another_seed_others() -> None:
    assert small() == small()
    assert small() != small(seed=4)


def test_requests_arrive_at_a_fixed_rate() -> None:
    requests = small()
    assert [r.at_s for r in requests] == [k / 4.0 for k in range(30)]


def test_every_session_takes_one_round_in_each_pass_over_the_sessions() -> None:
    requests = small()
    assert len(requests) == 30
    passes = [requests[i : i + 6] for i in range(0, 30, 6)]
    assert all(sorted(r.session or 0 for r in p) == list(range(6)) for p in passes)
    orders = [[r.session for r in p] for p in passes]
    assert orders[0] != list(range(6)) and all(o == orders[0] for o in orders)  # shuffled, kept


def test_each_round_resends_the_whole_history_plus_a_new_message() -> None:
    for turns in by_session(small()).values():
        assert len(turns) == 5
        for prev, turn in pairwise(turns):
            prev_messages, messages = prev.body["messages"], turn.body["messages"]
            assert turn.prompt.startswith(prev.prompt)
            assert messages[: len(prev_messages)] == prev_messages
            assert [m["role"] for m in messages[len(prev_messages) :]] == ["assistant", "user"]
            new_tokens = len(messages[-1]["content"]) / BYTES_PER_TOKEN
            assert 10 <= new_tokens <= 20
            assert len(messages[-2]["content"]) == 32 * BYTES_PER_TOKEN  # the fixed answer


def test_sessions_of_a_group_share_its_system_prompt_and_groups_do_not() -> None:
    systems = {
        s: turns[0].body["messages"][0]["content"] for s, turns in by_session(small()).items()
    }
    assert all(len(text) == 30 * BYTES_PER_TOKEN for text in systems.values())
    for a, text_a in systems.items():
        for b, text_b in systems.items():
            assert (text_a == text_b) == (a // 2 == b // 2), (a, b)


def test_max_tokens_stay_between_4_and_the_pods_maximum() -> None:
    sizes = {r.body["max_tokens"] for r in small()}
    assert min(sizes) >= 4 and max(sizes) <= SIZING.max_output_tokens and len(sizes) > 1


def test_a_history_too_long_for_the_pods_starts_over_as_a_new_session() -> None:
    sizing = Sizing(max_prompt_tokens=120)
    requests = small(sizing)
    assert max(len(r.prompt) for r in requests) <= 120 * BYTES_PER_TOKEN
    sessions = by_session(requests)
    assert len(sessions) > 6 and set(range(6)) < set(sessions)
    for turns in sessions.values():
        first = turns[0].body["messages"]
        assert [m["role"] for m in first] == ["system", "user"]
        assert all(b.prompt.startswith(a.prompt) for a, b in pairwise(turns))


@pytest.mark.parametrize(
    ("kind", "count", "groups", "sessions", "duration_s", "max_tokens"),
    [("sim", 1000, 13, 65, 49.95, 8000), ("vllm", 120, 3, 9, 59.5, 280)],
)
def test_routing_quality_sizes_groups_for_each_pod_set(
    kind: str, count: int, groups: int, sessions: int, duration_s: float, max_tokens: int
) -> None:
    assert "groups" in WORKLOADS
    requests = build_workload("groups", kind, argparse.Namespace())
    assert len(requests) == count
    assert requests[-1].at_s == pytest.approx(duration_s)
    assert max(len(r.prompt) for r in requests) <= max_tokens * BYTES_PER_TOKEN
    assert len({r.body["messages"][0]["content"] for r in requests}) == groups
    assert {r.session for r in requests[:sessions]} == set(range(sessions))


def test_routing_quality_sizes_lora_so_its_p99_is_not_a_handful_of_requests() -> None:
    """192 chats of 4 turns on 16 adapters (issue 32): a p99 of 768 requests, not the
    third-slowest of 256 (the docs' LoRA figures are of this size)."""
    requests = build_workload("lora", "sim", argparse.Namespace())
    chats = by_session(requests)
    assert len(requests) == 768 and len(chats) == 192
    assert {len(turns) for turns in chats.values()} == {4}
    assert {r.body["model"] for r in requests} == {f"lora-{k}" for k in range(16)}
    assert all(len({t.body["model"] for t in turns}) == 1 for turns in chats.values())
