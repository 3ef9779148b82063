"""SessionBook: which conversation a request continues (its prompt grown by a whole block
past a session's tip, or its session header), when a session is returning, and the live
returning sessions each pod holds as sessions move, go idle, overflow the book and lose
their pods. Prompts are hashed as estimated-ttft hashes them (64-byte blocks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from extproc.pods import PodId
from extproc.prefix.hashing import prompt_keys
from extproc.scheduling.plugins.session_book import Placement, SessionBook, SessionPrompt

BS, MAX_BLOCKS = 64, 512  # estimated-ttft's default geometry
# Two conversations' texts (every turn is a start of one), and a system prompt two
# tenants' prompts share: a prompt of it plus a question under a block ends inside it.
CHAT = "".join(f"user: question {i}? assistant: answer {i}, at length. " for i in range(2000))
OTHER = "".join(f"Q{i}: what next? A{i}: something else entirely. " for i in range(2000))
THIRD = "".join(f"note {i}: the meeting moved to room {i}. " for i in range(2000))
SYSTEM = "You are a helpful assistant for the billing team; be brief. " * 6  # 360 bytes


class Clock:
    """A fake monotonic clock the tests move on."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pod(name: str) -> PodId:
    return PodId("ns", name)


def session_prompt(prompt: str, key: str | None = None) -> SessionPrompt:
    keys = prompt_keys("m", prompt, BS, MAX_BLOCKS, None)
    return SessionPrompt(keys, BS, prompt.encode(), key)


def place(book: SessionBook, prompt: str, at: str, key: str | None = None) -> Placement:
    return book.place(session_prompt(prompt, key), pod(at))


def find(book: SessionBook, prompt: str, key: str | None = None) -> int | None:
    return book.find(session_prompt(prompt, key))


@dataclass(frozen=True)
class Step:
    prompt: str
    pod: str
    key: str | None = None


@dataclass(frozen=True)
class Expect:
    session: str  # a label: the same label, the same session; a new label, a new one
    returning: bool = False
    moved_from: str | None = None


@dataclass(frozen=True)
class Case:
    steps: list[Step]
    expected: list[Expect]
    counts: dict[str, int] = field(default_factory=dict)  # live returning sessions per pod


CASES = [
    pytest.param(
        Case(
            [Step(CHAT[:300], "a"), Step(CHAT[:400], "a"), Step(CHAT[:2000], "a")],
            [Expect("s1"), Expect("s1", True), Expect("s1", True)],
            {"a": 1},
        ),
        id="a-prompt-grown-by-a-whole-block-continues-its-session",
    ),
    pytest.param(
        Case(
            [Step(CHAT[:330], "a"), Step(CHAT[:380], "a")],  # 5 whole blocks both
            [Expect("s1"), Expect("s2")],
        ),
        id="grown-within-its-last-block-is-a-sibling-so-a-new-session",
    ),
    pytest.param(
        Case(
            [Step(CHAT[:300], "a"), Step(CHAT[:300], "b"), Step(CHAT[:400], "a")],
            [Expect("s1"), Expect("s2"), Expect("s2", True, "b")],
            {"a": 1},
        ),
        id="a-regenerate-is-a-new-session-that-the-conversation-continues",
    ),
    pytest.param(
        Case(
            [
                Step(SYSTEM + CHAT[:200], "a"),
                Step(SYSTEM + OTHER[:200], "b"),
                Step(SYSTEM + OTHER[:300], "b"),
                Step(SYSTEM + CHAT[:300], "a"),
            ],
            [Expect("s1"), Expect("s2"), Expect("s2", True), Expect("s1", True)],
            {"a": 1, "b": 1},
        ),
        id="conversations-sharing-a-system-prompt-stay-apart",
    ),
    pytest.param(
        Case(
            [
                Step(SYSTEM + "hi", "a"),  # both end inside the system prompt
                Step(SYSTEM + "yo", "a"),
                Step(SYSTEM + CHAT[:300], "a"),
                Step(SYSTEM + CHAT[:400], "a"),
            ],
            [Expect("s1"), Expect("s2"), Expect("s3"), Expect("s3", True)],
            {"a": 1},
        ),
        id="tenants-ending-in-the-system-prompt-are-not-continued",
    ),
    pytest.param(
        Case(
            [
                Step(SYSTEM + "hi?", "a"),  # its tip is inside the system prompt
                Step(SYSTEM + OTHER[:100], "a"),  # holds that tip, not the "hi?" after it
                Step(SYSTEM + OTHER[:200], "a"),
            ],
            [Expect("s1"), Expect("s2"), Expect("s2", True)],
            {"a": 1},
        ),
        id="a-prompt-sharing-a-sessions-tip-but-not-its-whole-prompt-is-not-continued",
    ),
    pytest.param(
        Case(
            [Step(CHAT[:40000], "a"), Step(CHAT[:41000], "a"), Step(CHAT[:42000], "a")],
            [Expect("s1"), Expect("s1", True), Expect("s1", True)],
            {"a": 1},
        ),
        id="past-the-hashed-range-a-conversation-still-continues",
    ),
    pytest.param(
        Case(
            [
                Step(CHAT[:300], "a", "k1"),
                Step(OTHER[:300], "a", "k1"),  # unrelated prompt, same header
                Step(CHAT[:400], "b", "k2"),  # extends k1's first prompt, another header
            ],
            [Expect("s1"), Expect("s1", True), Expect("s2")],
            {"a": 1},
        ),
        id="a-session-header-keys-its-session-whatever-the-prompt",
    ),
    pytest.param(
        Case(
            [Step(CHAT[:300], "a"), Step(CHAT[:400], "b")],
            [Expect("s1"), Expect("s1", True, "a")],
            {"b": 1},
        ),
        id="returning-on-another-pod-is-a-move",
    ),
    pytest.param(
        Case(
            [Step(CHAT[:300], "a"), Step(CHAT[:400], "a"), Step(CHAT[:500], "b")],
            [Expect("s1"), Expect("s1", True), Expect("s1", True, "a")],
            {"b": 1},
        ),
        id="a-moved-session-leaves-its-old-pods-count",
    ),
    pytest.param(
        Case(
            [
                Step(CHAT[:300], "a"),
                Step(CHAT[:400], "a"),
                Step(OTHER[:300], "b"),
                Step(OTHER[:400], "a"),
                Step(CHAT[:500], "b"),
                Step(OTHER[:500], "b"),
            ],
            [
                Expect("s1"),
                Expect("s1", True),
                Expect("s2"),
                Expect("s2", True, "b"),
                Expect("s1", True, "a"),
                Expect("s2", True, "a"),
            ],
            {"b": 2},
        ),
        id="counts-follow-every-move",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_which_session_a_request_continues(case: Case) -> None:
    """``find`` names the session ``place`` then binds; ``place`` tells whether it is
    returning and the pod it left; the pods' counts are the live returning sessions."""
    book = SessionBook()
    ids: dict[str, int] = {}
    for step, expect in zip(case.steps, case.expected, strict=True):
        found = find(book, step.prompt, step.key)
        placed = place(book, step.prompt, step.pod, step.key)
        if expect.session in ids:
            assert found == placed.session == ids[expect.session], step
        else:
            assert found is None and placed.session not in ids.values(), step
            ids[expect.session] = placed.session
        moved_from = None if expect.moved_from is None else pod(expect.moved_from)
        assert (placed.returning, placed.moved_from) == (expect.returning, moved_from), step
        assert book.session_pod(placed.session) == (pod(step.pod), expect.returning)
    assert book.returning_counts([pod("a"), pod("b")]) == {
        pod("a"): case.counts.get("a", 0),
        pod("b"): case.counts.get("b", 0),
    }
    assert len(book) == len(ids)


@pytest.mark.parametrize(
    ("idle_for", "live"),
    [
        pytest.param(120.0, True, id="live-at-idle-s"),
        pytest.param(120.5, False, id="dropped-past-idle-s"),
    ],
)
def test_an_idle_session_stops_counting(idle_for: float, live: bool) -> None:
    """A session idle past ``idle_s`` is dropped with its count; a newer one stays, and
    the dropped one's next request starts anew."""
    clock = Clock()
    book = SessionBook(idle_s=120.0, clock=clock)
    first = place(book, CHAT[:300], "a").session
    place(book, CHAT[:400], "a")
    clock.now = 60.0
    place(book, OTHER[:300], "a")
    place(book, OTHER[:400], "a")
    clock.now = idle_for
    assert book.returning_counts([pod("a")]) == {pod("a"): 2 if live else 1}
    assert len(book) == (2 if live else 1)
    again = place(book, CHAT[:500], "a")
    assert (again.session == first, again.returning) == (live, live)


@pytest.mark.parametrize(
    ("conversations", "dropped"),
    [
        pytest.param([CHAT, OTHER, THIRD], CHAT, id="the-least-recent-goes"),
        pytest.param([CHAT, OTHER, CHAT, THIRD], OTHER, id="a-request-renews-its-session"),
    ],
)
def test_the_book_keeps_at_most_max_sessions(conversations: list[str], dropped: str) -> None:
    """Each entry is one more turn (two requests) of a conversation; with room for two
    sessions, the least recently used is dropped with its count."""
    book = SessionBook(max_sessions=2)
    turns: dict[str, int] = {}
    sessions: dict[str, int] = {}
    for text in conversations:
        for _ in range(2):
            turns[text] = turns.get(text, 0) + 1
            sessions[text] = place(book, text[: 200 + 100 * turns[text]], "a").session
    assert len(book) == 2
    assert book.returning_counts([pod("a")]) == {pod("a"): 2}
    assert book.session_pod(sessions[dropped]) == (None, False)
    assert find(book, dropped[: 300 + 100 * turns[dropped]]) is None


def test_sessions_on_a_gone_pod_are_unplaced() -> None:
    """Their count goes with the pod; their next request is placed anew, returning, and
    is no move (there is no pod to have left)."""
    book = SessionBook()
    moved = place(book, CHAT[:300], "a").session
    place(book, CHAT[:400], "a")
    place(book, OTHER[:300], "b")
    place(book, OTHER[:400], "b")
    book.forget_pods({pod("b")})
    assert book.returning_counts([pod("a"), pod("b")]) == {pod("a"): 0, pod("b"): 1}
    assert book.session_pod(moved) == (None, True)
    again = place(book, CHAT[:500], "b")
    assert (again.session, again.returning, again.moved_from) == (moved, True, None)
    assert book.returning_counts([pod("a"), pod("b")]) == {pod("a"): 0, pod("b"): 2}


@pytest.mark.parametrize(("idle_s", "max_sessions"), [(0.0, 10), (-1.0, 10), (120.0, 0)])
def test_a_book_needs_positive_bounds(idle_s: float, max_sessions: int) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        SessionBook(idle_s, max_sessions)


def held(book: SessionBook, *names: str) -> dict[str, int]:
    """``held_bytes`` of each pod alone, checked against ``returning_rows`` (the per-row
    copy a pod table reads, built once and kept in step)."""
    pods = [pod(name) for name in names]
    rows = {p: i for i, p in enumerate(pods)}
    by_rows = book.returning_rows(rows, len(rows)).held.tolist()
    alone = {name: book.held_bytes([pod(name)]) for name in names}
    assert by_rows == [alone[name] for name in names]
    return alone


def test_each_pods_returning_sessions_prompts_are_summed() -> None:
    """Only returning sessions count, with their latest prompt; a move carries it to the
    new pod; expiry and a gone pod take it away; a replayed pick counts its keys' span."""
    clock = Clock()
    book = SessionBook(idle_s=120.0, clock=clock)
    rows = {pod("a"): 0, pod("b"): 1}
    book.returning_rows(rows, 2)  # rows built now: later changes must keep them in step
    place(book, CHAT[:300], "a")
    assert held(book, "a", "b") == {"a": 0, "b": 0}  # one request: not a session yet
    place(book, CHAT[:400], "a")
    place(book, OTHER[:300], "b")
    place(book, OTHER[:500], "b")
    assert held(book, "a", "b") == {"a": 400, "b": 500}
    assert book.held_bytes([pod("a"), pod("b")]) == 900
    place(book, CHAT[:700], "b")  # moved: its old prompt leaves a, its new one joins b
    assert held(book, "a", "b") == {"a": 0, "b": 1200}
    replayed = prompt_keys("m", OTHER[:900], BS, MAX_BLOCKS, None)
    book.place(SessionPrompt(replayed, BS, None), pod("b"))  # another replica's pick
    assert held(book, "a", "b") == {"a": 0, "b": 700 + len(replayed) * BS}
    clock.now = 121.0
    place(book, THIRD[:300], "a")
    place(book, THIRD[:600], "a")
    assert held(book, "a", "b") == {"a": 600, "b": 0}  # b's sessions went idle
    book.forget_pods({pod("b")})
    assert held(book, "a", "b") == {"a": 0, "b": 0}
