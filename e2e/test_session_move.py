"""Through real Envoy with the shipped default (estimated-ttft): a chat session whose pod
slows down moves to another pod once, and stays there when its first pod is idle again:
moving made the new pod hold its longest prefix (issue 35)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from e2e.support import MODEL, RECORDED, background_load, metric, served_by, unique_prefix
from extproc.request.parse import parse_request
from extproc.sim.launch import SimPods, Stack, run_stack, spawn_sim_pods
from testkit.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

# One request at a time per pod: requests sent to a pod beyond the first wait (scraped).
SLOW_POD_ARGS = ["--model", MODEL, "--max-num-seqs", "1"]
CHAT = "/v1/chat/completions"
# Kept on the slowed pod, bypassing Envoy: 1 running and 4 waiting, about 0.3 s each
# (40 decode steps), so it drains in under 2 s. Its estimate is then ~190 ms (~125 after
# the affinity margin) against ~40 ms for an idle pod recomputing the ~400-token history;
# 2 waiting (~110, ~60) still moves the session, 1 would not.
LOAD_WORKERS = 5
LOAD_BODY = {"model": MODEL, "prompt": "a long answer, please", "max_tokens": 40}
MIN_WAITING = 2
TURNS_BEFORE, TURNS_LOADED, TURNS_AFTER = 3, 3, 4
SCRAPES = ("extproc_scrape_duration_seconds_count", "")
MOVED = ("extproc_sessions_moved_total", "")
RECOMPUTED = ("extproc_sessions_moved_recomputed_tokens_total", "")
LIVE = ("extproc_sessions_live", "")


@pytest.fixture(scope="module")
def slow_pods() -> Iterator[SimPods]:
    with spawn_sim_pods(2, args=SLOW_POD_ARGS) as pods:
        yield pods


@pytest.fixture(scope="module")
def default_stack(slow_pods: SimPods) -> Iterator[Stack]:
    with run_stack(slow_pods.as_pods()) as stack:  # no config: the embedded default
        yield stack


class Chat:
    """One conversation through Envoy: each turn resends the whole history plus a new
    user message (no session header: extproc tells the session by the prompt it extends)."""

    def __init__(self, stack: Stack, client: httpx.Client) -> None:
        self.stack = stack
        self.client = client
        self.messages: list[dict[str, str]] = [{"role": "system", "content": unique_prefix()}]
        self.sent: list[dict[str, Any]] = []  # every turn's body, in order

    def next_body(self) -> dict[str, Any]:
        question = f"Question {len(self.sent) + 1}: what changed in routing since the last answer?"
        self.messages.append({"role": "user", "content": question})
        self.sent.append({"model": MODEL, "messages": list(self.messages), "max_tokens": 8})
        return self.sent[-1]

    def turn(self) -> str:
        """Send the next turn; the pod that served it, once extproc recorded it (so the
        next turn is scored on the prefix it left)."""
        recorded = metric(self.stack, *RECORDED)
        resp = self.client.post(CHAT, json=self.next_body())
        pod = served_by(resp)
        reply = resp.json()["choices"][0]["message"]["content"]
        self.messages.append({"role": "assistant", "content": reply})
        wait_until(lambda: metric(self.stack, *RECORDED) > recorded, 10, what="turn not recorded")
        return pod

    def turns(self, count: int) -> list[str]:
        return [self.turn() for _ in range(count)]


def engine(sim: SimPods, pod: str) -> dict[str, Any]:
    return sim.stats(pod)["engine"]  # type: ignore[no-any-return]


def wait_for_sweeps(stack: Stack, sim: SimPods) -> None:
    """extproc scraped every pod since now: two sweeps' worth of scrapes (one in
    progress may have started before)."""
    scraped = metric(stack, *SCRAPES)
    sweeps = 2 * len(sim.pods)
    wait_until(lambda: metric(stack, *SCRAPES) >= scraped + sweeps, 10, what="no fresh scrape")


def prompt_tokens(body: dict[str, Any]) -> int:
    """extproc's estimate of the chat's rendered prompt: ceil(bytes / 4)."""
    prompt = parse_request(CHAT, orjson.dumps(body)).prompt
    return -(-len(prompt.encode()) // 4)


def test_a_session_moves_once_off_a_slowed_pod_and_not_back(
    default_stack: Stack, slow_pods: SimPods
) -> None:
    with httpx.Client(base_url=default_stack.url, timeout=30) as client:
        chat = Chat(default_stack, client)
        before = chat.turns(TURNS_BEFORE)
        slowed = before[0]
        assert before == [slowed] * TURNS_BEFORE
        assert metric(default_stack, *MOVED) == 0
        slowed_url = next(p.url for p in slow_pods.pods if p.name == slowed)
        with background_load(slowed_url, lambda i: LOAD_BODY, workers=LOAD_WORKERS) as load:
            wait_until(
                lambda: engine(slow_pods, slowed)["num_waiting"] >= LOAD_WORKERS - 1,
                10,
                what=lambda: engine(slow_pods, slowed),
            )
            wait_for_sweeps(default_stack, slow_pods)
            loaded = chat.turns(TURNS_LOADED)
            assert engine(slow_pods, slowed)["num_waiting"] >= MIN_WAITING  # still slow
        assert set(load.statuses()) == {200} and {pod for *_, pod in load.outcomes} == {slowed}
        moved_to = loaded[0]
        assert moved_to != slowed
        assert loaded == [moved_to] * TURNS_LOADED
        assert metric(default_stack, *MOVED) == 1
        # the move recomputed the whole history on a pod that held none of it
        assert metric(default_stack, *RECOMPUTED) == prompt_tokens(chat.sent[TURNS_BEFORE])

        wait_until(
            lambda: (
                engine(slow_pods, slowed)["num_waiting"] == 0
                and engine(slow_pods, slowed)["num_running"] == 0
            ),
            15,
            what=lambda: engine(slow_pods, slowed),
        )
        wait_for_sweeps(default_stack, slow_pods)  # extproc sees the slowed pod idle
        assert chat.turns(TURNS_AFTER) == [moved_to] * TURNS_AFTER
    assert metric(default_stack, *MOVED) == 1
    assert metric(default_stack, *LIVE) == 1
