"""Which conversation a request continues, and where each live conversation is placed.

A *session* is a conversation: the requests carrying one session key (the configured
session header), or, without one, a chain of prompts each extending an earlier one (a
chat resends its history, so its next prompt starts with the previous one). A prompt's
*tip* is the key of its last whole block (a partial last block changes as the prompt
grows; past the hashed range, the last hashed block). A request continues the session
whose latest tip is one of its block keys, deepest first, when it holds that session's
whole latest prompt and is longer: the bytes after the tip match (a digest of them is
kept), so prompts that merely share a block (tenants' one-shot questions after one
system prompt) are not chained. Its own tip then replaces that one; a tip reached by
two sessions belongs to the newer. A prompt that continues none starts a new session.
A pick replayed from another replica carries keys but no prompt: its tip is its
next-to-last key (its last may be partial) and it is matched by keys alone.

A session is *returning* once it has sent a second request: only returning sessions
count towards a pod's load, so one-shot requests that share a system prompt (tenants of
an application) are not taken for conversations about to grow. Each pod's returning
sessions' latest prompts are also summed (their bytes, or for a replayed pick its keys'
span): how much of the pod's cache its conversations' histories take now. A session
stays live ``idle_s`` after its latest request; the book keeps at most ``max_sessions``
(least recently used dropped first), so memory stays bounded whatever clients send.

``place`` binds a session to the pod picked for its request: a session picked elsewhere
than the pod of its previous request has *moved*. Thread-safe.

Keys are chained, so a key can only be a tip of a prompt that starts with the same first
block key (its *root*): the live tips are also kept per root, and a prompt whose root has
fewer live tips than it has keys to walk tests those tips only. ``lookup`` hands out
what it found with the book's version (bumped by whatever could change an answer), so
``place`` right after it, with nothing in between, skips the search.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import xxhash

from extproc.pods import PodId
from extproc.prefix.hashing import Keys

# Versions are drawn from one counter for every book, so what one book found never
# passes for another's.
_versions = itertools.count()
_digest = xxhash.xxh3_64_intdigest  # of a memoryview: a prompt's bytes are not copied


class SessionPrompt(NamedTuple):
    """What the book reads of a request."""

    keys: Keys  # the prompt's chained block keys
    block_size: int  # bytes per block of ``keys``
    data: bytes | None  # the rendered prompt; None for a pick replayed from another replica
    session_key: str | None = None  # the session header's value

    def tip_index(self) -> int:
        """The index of the tip (module doc) in ``keys``; -1 when there is none."""
        if self.data is None:
            return len(self.keys) - 2
        return min(len(self.data) // self.block_size, len(self.keys)) - 1

    def size(self) -> int:
        """The prompt's bytes; for a replayed pick (no prompt), its keys' span."""
        return len(self.keys) * self.block_size if self.data is None else len(self.data)

    def walk_from(self, tip: int) -> int:
        """The deepest key a continued session's tip may be: before the tip, unless the
        prompt runs past the hashed range (then it grew beyond the keys)."""
        beyond = self.data is not None and len(self.data) > len(self.keys) * self.block_size
        return tip if beyond else tip - 1


@dataclass(slots=True)
class Session:
    pod: PodId | None
    tip: int | None  # its latest prompt's tip key (None: keyed by header only)
    requests: int
    last_s: float
    end: int = 0  # its latest prompt's length in bytes (0: unknown, a replayed pick)
    size: int = 0  # its latest prompt's bytes as summed per pod (keys' span if unknown)
    tail: int = 0  # digest of that prompt's bytes after the tip
    root: int = 0  # its latest prompt's first block key (when ``tip`` is not None)


class SessionRows(NamedTuple):
    """Per row of a pod table: each pod's live returning sessions and their latest
    prompts' bytes (``returning_counts`` and ``held_bytes`` of the pod alone)."""

    counts: npt.NDArray[np.float64]
    held: npt.NDArray[np.float64]


class _Rows(NamedTuple):
    """``SessionRows`` of the latest pod table read, and its rows (``SessionBook._rows``)."""

    rows: Mapping[PodId, int]  # pod -> row
    counts: npt.NDArray[np.float64]
    held: npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Placement:
    """What ``place`` did: the session's id, whether it returned (its second request or
    later), and the pod it left (None when it stayed or is new)."""

    session: int
    returning: bool
    moved_from: PodId | None


class Found(NamedTuple):
    """What ``lookup`` found, and the book's version then (see ``place``)."""

    session: int | None
    version: int


class SessionBook:
    def __init__(
        self,
        idle_s: float = 120.0,
        max_sessions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if idle_s <= 0 or max_sessions <= 0:
            raise ValueError(f"idle_s and max_sessions must be > 0, got {idle_s}, {max_sessions}")
        self._idle_s = idle_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[int, Session] = OrderedDict()  # least recent first
        self._by_tip: dict[int, int] = {}  # tip key -> session
        self._tips: dict[int, dict[int, int]] = {}  # root -> {tip key in _by_tip: its index}
        self._version = next(_versions)
        self._by_key: dict[str, int] = {}
        self._key_of: dict[int, str] = {}
        self._returning: dict[PodId, int] = {}  # live returning sessions per pod
        self._held: dict[PodId, int] = {}  # their latest prompts' bytes (``size``) per pod
        # ``_returning`` and ``_held`` per row of the latest pod table read (its rows, the
        # counts, the bytes), kept in step by ``_add_returning``: a read copies an array,
        # no step per pod.
        self._rows: _Rows | None = None
        self._next_id = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def idle_s(self) -> float:
        return self._idle_s

    @idle_s.setter
    def idle_s(self, idle_s: float) -> None:
        """A reload sets it: what was found before (maybe with other block geometry)
        is searched again."""
        with self._lock:
            self._idle_s = idle_s
            self._version = next(_versions)

    def find(self, prompt: SessionPrompt) -> int | None:
        """The session a request continues, or None."""
        return self.lookup(prompt).session

    def lookup(self, prompt: SessionPrompt) -> Found:
        """``find``, with the book's version for ``place``."""
        with self._lock:
            self._expire(self._clock())
            return Found(self._find(prompt), self._version)

    def _find(self, prompt: SessionPrompt) -> int | None:
        if prompt.session_key is not None:
            return self._by_key.get(prompt.session_key)
        if not self._by_tip:
            return None
        start = prompt.walk_from(prompt.tip_index())
        if start < 0:
            return None
        keys = prompt.keys
        tips = self._tips.get(int(keys[0]))
        if tips is None:
            return None  # no live tip starts as this prompt does
        if len(tips) <= start:
            return self._find_among(prompt, start, tips)
        return self._walk(prompt, start)

    def _find_among(self, prompt: SessionPrompt, start: int, tips: dict[int, int]) -> int | None:
        """``_walk`` over the tips of the prompt's root only: those its keys reach."""
        keys = prompt.keys
        reached = sorted(
            ((i, tip) for tip, i in tips.items() if i <= start and keys[i] == tip), reverse=True
        )
        for i, tip in reached:  # deepest first
            found = self._by_tip[tip]
            if self._extends(prompt, i, self._sessions[found]):
                return found
        return None

    def _walk(self, prompt: SessionPrompt, start: int) -> int | None:
        """The first session whose tip is one of the prompt's keys, deepest first, that
        the prompt extends."""
        by_tip = self._by_tip
        candidates = prompt.keys[: start + 1].tolist()  # plain ints: a dict probe each
        for i in range(start, -1, -1):
            found = by_tip.get(candidates[i])
            if found is not None and self._extends(prompt, i, self._sessions[found]):
                return found
        return None

    @staticmethod
    def _extends(prompt: SessionPrompt, tip: int, s: Session) -> bool:
        """Whether ``prompt`` holds ``s``'s whole latest prompt (whose tip is key ``tip``)."""
        data = prompt.data
        if data is None or not s.end:
            return True  # keys alone: no prompt to compare
        after = (tip + 1) * prompt.block_size
        return len(data) > s.end and _digest(memoryview(data)[after : s.end]) == s.tail

    def session_pod(self, session: int | None) -> tuple[PodId | None, bool]:
        """The pod a session is placed on, and whether it is returning."""
        if session is None:
            return None, False
        with self._lock:
            s = self._sessions.get(session)
            return (None, False) if s is None else (s.pod, s.requests >= 2)

    def place(self, prompt: SessionPrompt, pod: PodId, looked_up: Found | None = None) -> Placement:
        """Bind the session of a request picked for ``pod`` (a new one if it continues
        none) to ``pod``; its tip becomes the request's. ``looked_up``: what ``lookup``
        found for the same prompt, reused if the book is still at its version."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            if looked_up is not None and looked_up.version == self._version:
                found = looked_up.session
            else:
                found = self._find(prompt)
            self._version = next(_versions)
            if found is None:
                found = self._new(prompt.session_key, now)
            s = self._sessions[found]
            moved_from = s.pod if s.pod is not None and s.pod != pod else None
            if s.requests >= 2 and s.pod is not None:
                self._add_returning(s.pod, -1, -s.size)
            s.requests += 1
            s.pod, s.last_s = pod, now
            s.size = prompt.size()
            if s.requests >= 2:
                self._add_returning(pod, 1, s.size)
            self._set_tip(found, s, prompt)
            self._sessions.move_to_end(found)
            return Placement(found, s.requests >= 2, moved_from)

    def _set_tip(self, sid: int, s: Session, prompt: SessionPrompt) -> None:
        index = prompt.tip_index()
        if index < 0:
            return
        self._unlink(sid, s)
        keys = prompt.keys
        s.tip, s.root = int(keys[index]), int(keys[0])
        older = self._by_tip.get(s.tip)
        if older is not None:  # a tip two sessions reach is the newer's
            self._unlink(older, self._sessions[older])
        self._by_tip[s.tip] = sid
        self._tips.setdefault(s.root, {})[s.tip] = index
        data = prompt.data
        if data is None:
            s.end = s.tail = 0
        else:
            s.end = len(data)
            s.tail = _digest(memoryview(data)[(index + 1) * prompt.block_size :])

    def _unlink(self, sid: int, s: Session) -> None:
        """Take ``s``'s tip out of the indexes if it still leads to ``sid``."""
        tip = s.tip
        if tip is None or self._by_tip.get(tip) != sid:
            return
        del self._by_tip[tip]
        tips = self._tips[s.root]
        del tips[tip]
        if not tips:
            del self._tips[s.root]

    def _new(self, session_key: str | None, now: float) -> int:
        sid = self._next_id
        self._next_id += 1
        self._sessions[sid] = Session(None, None, 0, now)
        if session_key is not None:
            self._by_key[session_key] = sid
            self._key_of[sid] = session_key
        while len(self._sessions) > self.max_sessions:
            self._drop(next(iter(self._sessions)))
        return sid

    def _expire(self, now: float) -> None:
        sessions = self._sessions
        while sessions:
            sid, s = next(iter(sessions.items()))
            if now - s.last_s <= self._idle_s:
                return
            self._drop(sid)

    def _drop(self, sid: int) -> None:
        self._version = next(_versions)
        s = self._sessions.pop(sid)
        if s.requests >= 2 and s.pod is not None:
            self._add_returning(s.pod, -1, -s.size)
        self._unlink(sid, s)
        key = self._key_of.pop(sid, None)
        if key is not None and self._by_key.get(key) == sid:
            del self._by_key[key]

    def _add_returning(self, pod: PodId, delta: int, size: int) -> None:
        count = self._returning[pod] = self._returning.get(pod, 0) + delta
        held = self._held[pod] = self._held.get(pod, 0) + size
        if self._rows is not None and (row := self._rows.rows.get(pod)) is not None:
            self._rows.counts[row] = count
            self._rows.held[row] = held

    def returning_counts(self, pods: Iterable[PodId]) -> dict[PodId, int]:
        """Live returning sessions placed on each of ``pods``."""
        with self._lock:
            self._expire(self._clock())
            return {pod: self._returning.get(pod, 0) for pod in pods}

    def held_bytes(self, pods: Iterable[PodId]) -> int:
        """The bytes of the latest prompts of the live returning sessions on ``pods``."""
        with self._lock:
            self._expire(self._clock())
            return sum(self._held.get(pod, 0) for pod in pods)

    def returning_rows(self, rows: Mapping[PodId, int], num_rows: int) -> SessionRows:
        """``SessionRows`` of a pod table (``rows``: pod -> row), both read at one moment."""
        with self._lock:
            kept = self._rows_of(rows, num_rows)
            return SessionRows(kept.counts.copy(), kept.held.copy())

    def _rows_of(self, rows: Mapping[PodId, int], num_rows: int) -> _Rows:
        self._expire(self._clock())
        kept = self._rows
        if kept is None or kept.rows is not rows or len(kept.counts) != num_rows:
            kept = self._rows = _Rows(
                rows, np.zeros(num_rows, dtype=np.float64), np.zeros(num_rows, dtype=np.float64)
            )
            for pod, n in self._returning.items():
                if (row := rows.get(pod)) is not None:
                    kept.counts[row] = n
                    kept.held[row] = self._held.get(pod, 0)
        return kept

    def forget_pods(self, keep: set[PodId]) -> None:
        """Sessions on pods that are gone are unplaced (placed anew by their next request)."""
        with self._lock:
            for s in self._sessions.values():
                if s.pod is not None and s.pod not in keep:
                    s.pod = None
            self._returning = {pod: n for pod, n in self._returning.items() if pod in keep}
            self._held = {pod: n for pod, n in self._held.items() if pod in keep}
            self._rows = None
