"""SessionBook's search by root and its reuse of a lookup decide exactly as the plain
walk did: on generated streams of requests (conversations growing under shared or
distinct system prompts, regenerates, session headers, picks replayed without their
prompt, idle time, a book of a few sessions, pods going away, lookups placed at once or
after other requests), every answer matches ``WalkBook``, the book before the index."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

from extproc.pods import PodId
from extproc.prefix.hashing import prompt_keys
from extproc.scheduling.plugins.session_book import Found, Placement, SessionBook, SessionPrompt

BS, MAX_BLOCKS = 8, 12  # small blocks: many keys per prompt, and prompts past the hashed range
IDLE_S = 10.0
# First blocks that conversations share (or not: ""), and the conversations' texts.
ROOTS = ["", "You are kind. ", "Answer in French, briefly. " * 2]
CONVERSATIONS = ["".join(f"{name}{i}; " for i in range(40)) for name in ("q", "chat", "x")]
PODS = [PodId("ns", name) for name in "abc"]
ROWS = {pod: row for row, pod in enumerate(PODS)}  # a pod table's rows


@dataclass(slots=True)
class RefSession:
    pod: PodId | None
    tip: int | None
    requests: int
    last_s: float
    end: int = 0
    tail: int = 0


class WalkBook:
    """The book as it was before the per-root index: every prompt walks its keys from
    the tip back to block 0, a probe of all live tips each, on ``find`` and on ``place``."""

    def __init__(self, idle_s: float, max_sessions: int, clock: Clock) -> None:
        self.idle_s, self.max_sessions, self.clock = idle_s, max_sessions, clock
        self.sessions: OrderedDict[int, RefSession] = OrderedDict()
        self.by_tip: dict[int, int] = {}
        self.by_key: dict[str, int] = {}
        self.key_of: dict[int, str] = {}
        self.next_id = 0

    def find(self, prompt: SessionPrompt) -> int | None:
        self.expire()
        if prompt.session_key is not None:
            return self.by_key.get(prompt.session_key)
        start = prompt.walk_from(prompt.tip_index())
        for i in range(start, -1, -1):
            found = self.by_tip.get(int(prompt.keys[i]))
            if found is not None and self.extends(prompt, i, self.sessions[found]):
                return found
        return None

    @staticmethod
    def extends(prompt: SessionPrompt, tip: int, s: RefSession) -> bool:
        data = prompt.data
        if data is None or not s.end:
            return True
        after = (tip + 1) * prompt.block_size
        return len(data) > s.end and xxhash.xxh3_64_intdigest(data[after : s.end]) == s.tail

    def place(self, prompt: SessionPrompt, pod: PodId) -> Placement:
        found = self.find(prompt)
        if found is None:
            found = self.new(prompt.session_key)
        s = self.sessions[found]
        moved_from = s.pod if s.pod is not None and s.pod != pod else None
        s.requests += 1
        s.pod, s.last_s = pod, self.clock.now
        index = prompt.tip_index()
        if index >= 0:
            if s.tip is not None and self.by_tip.get(s.tip) == found:
                del self.by_tip[s.tip]
            s.tip = int(prompt.keys[index])
            self.by_tip[s.tip] = found
            data = prompt.data
            s.end = 0 if data is None else len(data)
            s.tail = 0 if data is None else xxhash.xxh3_64_intdigest(data[(index + 1) * BS :])
        self.sessions.move_to_end(found)
        return Placement(found, s.requests >= 2, moved_from)

    def new(self, session_key: str | None) -> int:
        sid = self.next_id
        self.next_id += 1
        self.sessions[sid] = RefSession(None, None, 0, self.clock.now)
        if session_key is not None:
            self.by_key[session_key] = sid
            self.key_of[sid] = session_key
        while len(self.sessions) > self.max_sessions:
            self.drop(next(iter(self.sessions)))
        return sid

    def expire(self) -> None:
        while self.sessions:
            sid, s = next(iter(self.sessions.items()))
            if self.clock.now - s.last_s <= self.idle_s:
                return
            self.drop(sid)

    def drop(self, sid: int) -> None:
        s = self.sessions.pop(sid)
        if s.tip is not None and self.by_tip.get(s.tip) == sid:
            del self.by_tip[s.tip]
        key = self.key_of.pop(sid, None)
        if key is not None and self.by_key.get(key) == sid:
            del self.by_key[key]

    def forget_pods(self, keep: set[PodId]) -> None:
        for s in self.sessions.values():
            if s.pod is not None and s.pod not in keep:
                s.pod = None

    def session_pods(self) -> dict[int, tuple[PodId | None, bool]]:
        self.expire()
        return {sid: (s.pod, s.requests >= 2) for sid, s in self.sessions.items()}

    def returning_counts(self) -> dict[PodId, int]:
        self.expire()
        counts = dict.fromkeys(PODS, 0)
        for s in self.sessions.values():
            if s.requests >= 2 and s.pod is not None:
                counts[s.pod] += 1
        return counts


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Request(NamedTuple):
    root: int  # index in ROOTS
    conversation: int  # index in CONVERSATIONS
    length: int  # bytes of the conversation after the root
    session_key: str | None
    replayed: bool  # a pick from another replica: keys, no prompt

    def prompt(self) -> SessionPrompt:
        text = ROOTS[self.root] + CONVERSATIONS[self.conversation][: self.length]
        keys = prompt_keys("m", text, BS, MAX_BLOCKS, None)
        return SessionPrompt(keys, BS, None if self.replayed else text.encode(), self.session_key)


requests = st.builds(
    Request,
    st.integers(0, len(ROOTS) - 1),
    st.integers(0, len(CONVERSATIONS) - 1),
    st.one_of(st.sampled_from([0, 20, 40, 70, 100, 160]), st.integers(0, 160)),  # turns, or any
    st.one_of(st.none(), st.none(), st.sampled_from(["k1", "k2"])),
    st.sampled_from([False, False, False, True]),
)
pods = st.integers(0, len(PODS) - 1)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("place"), requests, pods),  # placed without a lookup
        st.tuples(st.just("lookup"), requests, pods),  # held until a "place_looked_up"
        st.tuples(st.just("place_looked_up"), st.integers(0, 7), pods),
        st.tuples(st.just("tick"), st.floats(0.0, 6.0), pods),
        st.tuples(st.just("forget"), st.integers(0, len(PODS) - 1), pods),
    ),
    max_size=60,
)


def check_same(book: SessionBook, ref: WalkBook) -> None:
    """What the rest of the plugin reads of the book: its sessions' pods and counts."""
    assert book.returning_counts(PODS) == ref.returning_counts()  # both expire first
    # The rows kept in step between reads (ROWS: one table read again and again).
    expected = [float(ref.returning_counts().get(pod, 0)) for pod in PODS]
    assert book.returning_rows(ROWS, len(PODS)).counts.tolist() == expected
    pods_of = ref.session_pods()
    assert len(book) == len(pods_of)
    assert {sid: book.session_pod(sid) for sid in pods_of} == pods_of


@settings(max_examples=400, deadline=None)
@given(operations, st.integers(1, 4))
@example(  # two sessions' tips reached (header-keyed ones): the deeper is continued
    [
        ("place", Request(1, 1, 40, "k1", False), 0),
        ("place", Request(1, 1, 80, "k2", False), 1),
        ("place", Request(1, 1, 120, None, False), 2),
    ],
    4,
)
@example(  # the session looked up went idle before its place
    [
        ("place", Request(0, 0, 40, None, False), 0),
        ("lookup", Request(0, 0, 80, None, False), 0),
        ("tick", 6.0, 0),
        ("tick", 6.0, 0),
        ("place_looked_up", 0, 0),
    ],
    4,
)
def test_the_index_and_the_reused_lookup_decide_as_the_walk(
    ops: list[tuple[str, object, int]], max_sessions: int
) -> None:
    clock = Clock()
    book = SessionBook(IDLE_S, max_sessions, clock)
    ref = WalkBook(IDLE_S, max_sessions, clock)
    looked_up: list[tuple[SessionPrompt, Found]] = []
    for kind, arg, pod_index in ops:
        pod = PODS[pod_index]
        if kind == "tick":
            assert isinstance(arg, float)
            clock.now += arg
        elif kind == "forget":
            assert isinstance(arg, int)
            keep = set(PODS) - {PODS[arg]}
            book.forget_pods(keep)
            ref.forget_pods(keep)
        elif kind == "lookup":
            assert isinstance(arg, Request)
            prompt = arg.prompt()
            found = book.lookup(prompt)
            assert found.session == ref.find(prompt), arg
            looked_up.append((prompt, found))
        elif kind == "place_looked_up" and looked_up:
            assert isinstance(arg, int)
            prompt, found = looked_up.pop(arg % len(looked_up))
            assert book.place(prompt, pod, found) == ref.place(prompt, pod), prompt
        elif kind == "place":
            assert isinstance(arg, Request)
            prompt = arg.prompt()
            assert book.find(prompt) == ref.find(prompt), arg
            assert book.place(prompt, pod) == ref.place(prompt, pod), arg
        check_same(book, ref)


def test_a_lookup_is_searched_again_after_a_reload() -> None:
    """A reload (a new idle time, maybe a new block geometry) makes earlier lookups
    stale: ``place`` searches again instead of taking the session found before."""
    book = SessionBook()
    chat = Request(1, 1, 100, None, False)
    first = book.place(chat.prompt(), PODS[0]).session
    found = book.lookup(chat._replace(length=140).prompt())
    assert found.session == first
    book.idle_s = 60.0
    other = book.place(Request(2, 2, 100, None, False).prompt(), PODS[0], found)
    assert other.session != first


def test_a_lookup_placed_at_once_is_not_searched_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request scored (``lookup``) then placed with nothing in between searches the
    book once; another request placed in between makes it search again."""
    searches: list[SessionPrompt] = []
    search = SessionBook._find

    def counted(book: SessionBook, prompt: SessionPrompt) -> int | None:
        searches.append(prompt)
        return search(book, prompt)

    monkeypatch.setattr(SessionBook, "_find", counted)
    book = SessionBook()
    chat, other = Request(1, 1, 100, None, False).prompt(), Request(2, 2, 100, None, False).prompt()
    book.place(chat, PODS[0], book.lookup(chat))
    assert searches == [chat]
    found = book.lookup(chat)
    book.place(other, PODS[1])
    book.place(chat, PODS[0], found)
    assert searches == [chat, chat, other, chat]
