"""bench.routing_quality.lost_histories: chat turns that did not find their own history
cached; bench.replay reads the prompt and cached tokens from a stream's usage chunk."""

from __future__ import annotations

import asyncio

import httpx
import orjson

from bench.replay import Outcome, _one
from bench.report import table
from bench.routing_quality import aggregate, lost_histories, lost_turns
from bench.workloads import TimedRequest
from tests.bench.rows import run_row

BLOCK = 16


def turn(session: int, at_s: float, prompt: int, cached: int, e2e_s: float = 0.1) -> Outcome:
    return Outcome(True, 0.01, e2e_s, 4, at_s=at_s, session=session, prompt_tokens=prompt,
                   cached_tokens=cached)  # fmt: skip


def test_a_turn_that_misses_its_previous_prompt_is_counted_lost() -> None:
    outcomes = [
        turn(0, 0.0, 100, 0),
        turn(0, 1.0, 180, 96),  # 100 tokens before: 6 whole blocks, one of slack -> needs 80
        turn(0, 2.0, 260, 64),  # 180 before: needs 160, has 64 -> lost
        turn(1, 0.5, 100, 0),
        turn(1, 1.5, 180, 80),  # exactly the whole blocks less one: kept
    ]
    assert lost_histories(outcomes, BLOCK) == {"history_turns": 3, "history_lost": 1}


def test_turn_order_is_by_due_time_not_by_arrival_of_the_outcome() -> None:
    outcomes = [turn(0, 1.0, 180, 0), turn(0, 0.0, 100, 0)]
    assert lost_histories(outcomes, BLOCK) == {"history_turns": 1, "history_lost": 1}


def test_a_turn_sent_while_its_previous_one_ran_is_not_checked() -> None:
    outcomes = [turn(0, 0.0, 100, 0, e2e_s=2.0), turn(0, 1.0, 180, 0)]
    assert lost_histories(outcomes, BLOCK) == {}


def test_nothing_without_sessions_or_cached_tokens() -> None:
    no_session = [Outcome(True, 0.01, 0.1, 4, at_s=t, prompt_tokens=100, cached_tokens=0)
                  for t in (0.0, 1.0)]  # fmt: skip
    no_usage = [Outcome(True, 0.01, 0.1, 4, at_s=t, session=0) for t in (0.0, 1.0)]
    assert lost_histories(no_session, BLOCK) == {}
    assert lost_histories(no_usage, BLOCK) == {}


def test_repetitions_are_summed_and_the_table_shows_lost_of_checked() -> None:
    rows = aggregate([run_row(rep=0, history_turns=10, history_lost=1),
                      run_row(rep=1, history_turns=12, history_lost=2)])  # fmt: skip
    assert (rows[0]["history_turns"], rows[0]["history_lost"]) == (22, 3)
    assert "| 3 of 22 |" in table(rows)
    assert "| 1 2 |  |" in table(aggregate([run_row()]))  # a workload without chats: empty


def sse(*chunks: dict[str, object]) -> bytes:
    lines = [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks]
    return b"".join(lines) + b"data: [DONE]\n\n"


def test_replay_reads_prompt_and_cached_tokens_from_the_usage_chunk() -> None:
    usage = {"prompt_tokens": 180, "completion_tokens": 4,
             "prompt_tokens_details": {"cached_tokens": 96}}  # fmt: skip
    body = sse({"choices": [{"delta": {"content": "hi"}}]}, {"choices": [], "usage": usage})

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def one() -> Outcome:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://pod") as client:
            req = TimedRequest(1.5, "/v1/chat/completions", {"model": "m"}, "p", session=7)
            return await _one(client, req)

    out = asyncio.run(one())
    assert out.ok and (out.session, out.at_s) == (7, 1.5)
    assert (out.prompt_tokens, out.cached_tokens, out.completion_tokens) == (180, 96, 4)


def test_each_lost_turn_says_its_chat_its_place_and_when_it_was_due() -> None:
    outcomes = [
        turn(0, 0.0, 100, 0),
        turn(0, 1.0, 180, 96),
        turn(0, 2.0, 260, 64),  # the chat's third turn (place 2): needs 160
        turn(1, 0.5, 100, 0),
        turn(1, 1.5, 180, 0),  # place 1: needs 80
    ]
    assert lost_turns(outcomes, BLOCK) == [
        {"session": 0, "turn": 2, "at_s": 2.0, "cached": 64, "held": 160},
        {"session": 1, "turn": 1, "at_s": 1.5, "cached": 0, "held": 80},
    ]
    assert lost_turns(outcomes[:2], BLOCK) == []
