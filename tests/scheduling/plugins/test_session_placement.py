"""estimated-ttft's session placement, driven as the router drives it (score, pick the
best, count it in flight and arriving; at the response record and settle) on chat bodies
parsed as the router parses them, over pods of equal load.

The session rule: a new conversation goes to the pod growing the fewest live returning
sessions, though another caches its system prompt; one-shot requests sharing a system
prompt are tenants, not sessions, and keep their warm pod. The move rule: a returning
session on a crowded pod moves while its history is cheap to recompute, stays once it
is not, and does not move back."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import pytest
from prometheus_client import CollectorRegistry

from extproc.pods import Pod, PodId, PodMetrics
from extproc.request.parse import parse_request
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import Cycle, PluginContext
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT, EstimatedTTFTArgs
from testkit.factories import make_pod

HEADER = "x-session-id"
PODS = [make_pod(name) for name in "abcd"]  # idle snapshots: equal load
A, B, C, D = (pod.id for pod in PODS)
MOVED = "extproc_sessions_moved_total"
MOVED_TOKENS = "extproc_sessions_moved_recomputed_tokens_total"
HELD = "extproc_sessions_held_total"


def filler(label: str, num_bytes: int) -> str:
    """``num_bytes`` of text no other label's shares beyond its first characters."""
    text = "".join(f"{label} says {i}. " for i in range(num_bytes // 8 + 1))
    return text[:num_bytes]


class Conversation:
    """One chat: a system prompt, then turns; each turn's answer joins the history."""

    def __init__(self, name: str, system: str, turn_bytes: int = 200) -> None:
        self.name, self.system, self.turn_bytes = name, system, turn_bytes
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.turns = 0

    def next_body(self, new_bytes: int | None = None) -> bytes:
        """The next request's body: the history so far, the previous turn's answer and a
        new question (``new_bytes`` each; by default ``turn_bytes``)."""
        size = new_bytes or self.turn_bytes
        question = filler(f"{self.name} q{self.turns}", size)
        if self.turns:
            answer = filler(f"{self.name} a{self.turns}", size)
            self.messages.append({"role": "assistant", "content": answer})
        self.messages.append({"role": "user", "content": question})
        self.turns += 1
        return json.dumps({"model": "m", "messages": self.messages}).encode()


class Routed:
    """An estimated-ttft plugin, its in-flight counts and registry, driven per request as
    ``Router.route`` then ``Router.complete`` (success) drive the scheduler."""

    def __init__(self, args: EstimatedTTFTArgs, pods: Sequence[Pod] = PODS) -> None:
        self.registry = CollectorRegistry()
        self.in_flight = InFlight()
        self.plugin = EstimatedTTFT(args, PluginContext(self.registry, in_flight=self.in_flight))
        self.pods = list(pods)
        # per request routed: the tokens its pick prefills, and its prompt's
        self.prefilled: list[tuple[int, int]] = []

    def best(self, body: bytes, session: str | None = None) -> set[PodId]:
        """The pods scoring highest for ``body`` (scoring only)."""
        scores = self.plugin.score(cycle(body, session), self.pods)
        return {pod for pod, score in scores.items() if score == max(scores.values())}

    def route(self, body: bytes, session: str | None = None, to: PodId | None = None) -> PodId:
        """Score, pick the best (the first of equals in pod order; ``to`` forces the pick,
        to set a scene), serve and end the request; the pick."""
        c = cycle(body, session)
        scores = self.plugin.score(c, self.pods)
        pick = to or max(self.pods, key=lambda pod: scores[pod.id]).id
        tokens = c.num_prefill_tokens(pick)
        self.prefilled.append((tokens, c.num_prompt_tokens))
        self.in_flight.start(pick, tokens)
        self.plugin.arriving(c, pick)
        self.plugin.record(c, pick)  # success: recorded, then ended
        self.in_flight.end(pick, tokens)
        self.plugin.settled(c, pick)
        return pick

    def sessions(self) -> dict[PodId, int]:
        return self.plugin.sessions.returning_counts(pod.id for pod in self.pods)

    def counter(self, name: str) -> float:
        return self.registry.get_sample_value(name) or 0.0


def cycle(body: bytes, session: str | None) -> Cycle:
    headers = {HEADER: session} if session else None
    return Cycle(parse_request("/v1/chat/completions", body, headers, session_header=HEADER))


def crowd(
    routed: Routed, sessions: Mapping[PodId, int], keyed: bool, system: str | None = None
) -> None:
    """Live returning sessions on each pod: conversations of two turns placed there (by
    default each with a system prompt of its own)."""
    for pod, n in sessions.items():
        for i in range(n):
            name = f"{pod.name}{i}"
            talk = Conversation(name, system or f"Assistant to {name}.")
            key = f"{name}-key" if keyed else None
            routed.route(talk.next_body(), key, to=pod)
            routed.route(talk.next_body(), key, to=pod)


SHORT_SYSTEM = "You are a helpful assistant. Keep answers short and exact. " * 3  # ~180 bytes


@pytest.mark.parametrize("keyed", [False, True], ids=["by-prompt", "by-session-header"])
@pytest.mark.parametrize(
    ("sessions", "expected"),
    [
        pytest.param((3, 1, 0, 2), C, id="the-one-without-sessions"),
        pytest.param((2, 2, 2, 1), D, id="the-one-with-fewest"),
        pytest.param((3, 2, 1, 2), C, id="fewest-among-uneven"),
    ],
)
def test_a_new_conversation_goes_where_fewest_sessions_grow(
    sessions: tuple[int, ...], expected: PodId, keyed: bool
) -> None:
    """Pod a, the most crowded, caches the new conversation's short system prompt (from a
    one-shot request), which alone would win it the request (pinned: no write cost, which
    would also steer new prompts off the pods written most)."""
    routed = Routed(EstimatedTTFTArgs(writtenMs=0.0))
    crowd(routed, dict(zip((A, B, C, D), sessions, strict=True)), keyed)
    routed.route(Conversation("tenant", SHORT_SYSTEM).next_body(), to=A)
    assert routed.sessions() == dict(zip((A, B, C, D), sessions, strict=True))
    new = Conversation("new", SHORT_SYSTEM).next_body(1000)
    assert routed.best(new, "new-key" if keyed else None) == {expected}


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [
        # 6 live sessions over 4 pods (mean 1.5), their latest prompts about 1,100 tokens
        # in all: 1.5 x 1,100 / 4,000,000 = 0.0004 of the session term, 0.12 ms on a, less
        # than the 1 ms its cached system prompt saves
        pytest.param(1_000_000, A, id="sessions-fill-little-of-the-caches"),
        # 1.5 x 1,100 / 1,600 > 1: all of it, and the pod without sessions wins
        pytest.param(400, C, id="sessions-fill-the-caches"),
        pytest.param(None, C, id="cache-sizes-unknown"),
    ],
)
def test_the_session_rule_weighs_as_much_as_sessions_fill_the_caches(
    capacity: int | None, expected: PodId
) -> None:
    """The crowding term is weighed by ``min(1, mean sessions x the share of the
    candidates' KV caches their latest prompts fill)``: while a few short conversations
    fill little of the caches, a new one goes where its system prompt is cached."""
    metrics = PodMetrics(kv_capacity_tokens=capacity)
    pods = [make_pod(pod.id.name, metrics=metrics) for pod in PODS]
    routed = Routed(EstimatedTTFTArgs(writtenMs=0.0), pods)
    crowd(routed, dict(zip((A, B, C, D), (3, 1, 0, 2), strict=True)), keyed=False)
    routed.route(Conversation("tenant", SHORT_SYSTEM).next_body(), to=A)
    held = routed.plugin.sessions.held_bytes([A, B, C, D])
    assert 4_000 < held < 4_800  # about 1,100 tokens
    assert routed.best(Conversation("new", SHORT_SYSTEM).next_body(1000)) == {expected}


LONG_SYSTEM = "You answer for the billing team. Cite the policy section you used. " * 40


@pytest.mark.parametrize("keyed", [False, True], ids=["by-prompt", "by-session-header"])
def test_tenants_sharing_a_system_prompt_are_not_sessions(keyed: bool) -> None:
    """One-shot requests of an application (a long system prompt, each its own question)
    keep going to the pod that caches it: none of them is a returning session."""
    routed = Routed(EstimatedTTFTArgs())
    for i in range(6):
        tenant = Conversation(f"tenant{i}", LONG_SYSTEM, turn_bytes=100 + 60 * i)
        picked = routed.route(tenant.next_body(), f"tenant{i}" if keyed else None, to=A)
        assert picked == A
    assert routed.sessions() == dict.fromkeys((A, B, C, D), 0)
    one_shot = Conversation("tenant-next", LONG_SYSTEM, turn_bytes=300)
    assert routed.best(one_shot.next_body(), "tenant-next" if keyed else None) == {A}


def test_a_short_tenant_question_does_not_make_the_next_tenant_a_session() -> None:
    routed = Routed(EstimatedTTFTArgs())
    for i, question_bytes in enumerate((10, 300)):
        routed.route(Conversation(f"tenant{i}", LONG_SYSTEM, question_bytes).next_body(), to=A)
    assert routed.best(Conversation("tenant-next", LONG_SYSTEM, 300).next_body()) == {A}


def test_one_session_on_an_idle_pod_does_not_outweigh_long_queues() -> None:
    pods = [make_pod("idle"), *(make_pod(n, metrics=PodMetrics(waiting=10)) for n in "xyz")]
    routed = Routed(EstimatedTTFTArgs(), pods)
    crowd(routed, {pods[0].id: 1}, keyed=False)
    new = Conversation("new", "Be brief.").next_body(1000)
    assert routed.best(new) == {pods[0].id}


TUTOR = "You are a patient tutor for the physics course; show every step of working. " * 3


@pytest.mark.parametrize(
    ("others", "history_bytes", "moves"),
    [
        # counts without the session itself: a 2, the others 1 (mean 1.25): a costs 120 ms
        # more than any other pod, more than recomputing 1,200 bytes of history there ...
        pytest.param((2, 1, 1, 1), 1_200, True, id="crowded-short-history-moves"),
        # ... but less than 28,000 bytes (7,000 tokens, 140 ms)
        pytest.param((2, 1, 1, 1), 28_000, False, id="crowded-long-history-stays"),
        # a 4, the others 1 (mean 1.75): 257 ms more, past even that recompute
        pytest.param((4, 1, 1, 1), 28_000, True, id="very-crowded-long-history-moves"),
        # every pod alike: nothing to gain from moving
        pytest.param((1, 1, 1, 1), 1_200, False, id="even-pods-short-history-stays"),
    ],
)
def test_a_crowded_session_moves_once_while_its_history_is_cheap(
    others: tuple[int, ...], history_bytes: int, moves: bool
) -> None:
    """A returning session on pod a, its next turns routed: it moves off a crowded pod
    when the crowding costs more than recomputing its history elsewhere, and then stays
    where it went, though a still holds its older prefix (no ping-pong); each move is
    counted once, with the tokens the new pod prefills. Every conversation has the same
    system prompt (every pod holds it)."""
    routed = Routed(EstimatedTTFTArgs())
    crowd(routed, dict(zip((A, B, C, D), others, strict=True)), False, TUTOR)
    talk = Conversation("subject", TUTOR, turn_bytes=history_bytes // 3)
    routed.route(talk.next_body(), to=A)
    routed.route(talk.next_body(), to=A)
    assert routed.sessions()[A] == others[0] + 1
    picks = [routed.route(talk.next_body(200)) for _ in range(4)]
    assert len(set(picks)) == 1, picks  # wherever its next turn went, the later ones follow
    assert (picks[0] != A) is moves
    assert routed.counter(MOVED) == int(moves)
    recomputed, prompt_tokens = routed.prefilled[-4]
    assert routed.counter(MOVED_TOKENS) == (recomputed if moves else 0)
    if moves:
        assert routed.sessions()[picks[0]] == 2  # its own and the one already there
        assert routed.sessions()[A] == others[0]
        # it recomputed its history, not the system prompt every pod holds
        assert history_bytes // 4 < recomputed <= prompt_tokens - len(TUTOR) // 4


def test_a_conversation_past_the_hashed_blocks_stays_one_session() -> None:
    routed = Routed(EstimatedTTFTArgs())
    talk = Conversation("long", "You are a patient tutor.", turn_bytes=11_000)
    for _ in range(4):  # about 11, 33, 55 and 77 KB
        routed.route(talk.next_body(), to=A)
    assert (len(routed.plugin.sessions), routed.sessions()[A]) == (1, 1)


@pytest.mark.parametrize("turns_before", [1, 2], ids=["second-turn", "returning"])
@pytest.mark.parametrize(
    ("waiting", "capacity", "hold_share", "stays"),
    [
        pytest.param(0, 1_000_000, 0.5, True, id="no-queue-and-room-holds"),
        pytest.param(1, 1_000_000, 0.5, False, id="a-queue-lets-it-move"),
        # the other conversation's latest prompt (about 180 tokens) fills 9% of 2,000
        pytest.param(0, 2_000, 0.01, False, id="sessions-fill-the-share-lets-it-move"),
        pytest.param(0, 1_000_000, 0.0, False, id="hold-off"),
        pytest.param(0, None, 0.5, False, id="cache-size-unknown"),
    ],
)
def test_a_conversation_holds_its_pod_while_nothing_waits_and_its_cache_has_room(
    turns_before: int, waiting: int, capacity: int | None, hold_share: float, stays: bool
) -> None:
    """Pod a holds another live conversation, and three requests were routed there since
    its last scrape (counted as queued: 90 ms and their prefill); a has written every
    prompt so far (the whole write cost): the cost model alone moves the conversation to
    an idle pod, though a holds its history. The hold keeps it on a while a showed no
    waiting request and the live returning sessions there fill less than
    ``sessionHoldShare`` of its cache (``explain`` says so), and counts it as held; a
    moved conversation is counted as moved."""
    metrics = PodMetrics(kv_capacity_tokens=capacity)
    pods = [
        make_pod("a", metrics=PodMetrics(waiting=waiting, kv_capacity_tokens=capacity)),
        *(make_pod(name, metrics=metrics) for name in "bcd"),
    ]
    a = pods[0].id
    routed = Routed(EstimatedTTFTArgs(sessionHoldShare=hold_share), pods)
    crowd(routed, {a: 1}, keyed=False)
    assert 700 < routed.plugin.sessions.held_bytes([a]) < 800  # about 180 tokens
    talk = Conversation("subject", TUTOR, turn_bytes=300)
    for _ in range(turns_before):
        routed.route(talk.next_body(), to=a)
    for _ in range(3):
        routed.in_flight.start(a, 500)
    body = talk.next_body()
    explained = {t.pod: t.terms for t in routed.plugin.explain(cycle(body, None), pods)}
    assert [pod for pod, terms in explained.items() if terms["hold"]] == ([a] if stays else [])
    cheapest = min(explained, key=lambda pod: explained[pod]["cost_ms"])
    held, moved = routed.counter(HELD), routed.counter(MOVED)
    picked = routed.route(body)
    assert picked == cheapest
    assert (picked == a) is stays
    counted = (routed.counter(HELD) - held, routed.counter(MOVED) - moved)
    assert counted == ((1, 0) if stays else (0, 1))
