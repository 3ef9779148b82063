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
an application) are not taken for conversations about to grow. A session stays live
``idle_s`` after its latest request; the book keeps at most ``max_sessions`` (least
recently used dropped first), so memory stays bounded whatever clients send.

``place`` binds a session to the pod picked for its request: a session picked elsewhere
than the pod of its previous request has *moved*. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash

from extproc.pods import PodId
from extproc.prefix.hashing import Keys


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
    tail: int = 0  # digest of that prompt's bytes after the tip


@dataclass(frozen=True, slots=True)
class Placement:
    """What ``place`` did: the session's id, whether it returned (its second request or
    later), and the pod it left (None when it stayed or is new)."""

    session: int
    returning: bool
    moved_from: PodId | None


class SessionBook:
    def __init__(
        self,
        idle_s: float = 120.0,
        max_sessions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if idle_s <= 0 or max_sessions <= 0:
            raise ValueError(f"idle_s and max_sessions must be > 0, got {idle_s}, {max_sessions}")
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[int, Session] = OrderedDict()  # least recent first
        self._by_tip: dict[int, int] = {}
        self._by_key: dict[str, int] = {}
        self._key_of: dict[int, str] = {}
        self._returning: dict[PodId, int] = {}  # live returning sessions per pod
        self._next_id = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def find(self, prompt: SessionPrompt) -> int | None:
        """The session a request continues, or None."""
        with self._lock:
            self._expire(self._clock())
            return self._find(prompt)

    def _find(self, prompt: SessionPrompt) -> int | None:
        if prompt.session_key is not None:
            return self._by_key.get(prompt.session_key)
        by_tip, keys = self._by_tip, prompt.keys
        if not by_tip:
            return None
        start = prompt.walk_from(prompt.tip_index())
        if start < 0:
            return None
        candidates = keys[: start + 1].tolist()  # plain ints: a dict probe each, deepest first
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
        return len(data) > s.end and xxhash.xxh3_64_intdigest(data[after : s.end]) == s.tail

    def session_pod(self, session: int | None) -> tuple[PodId | None, bool]:
        """The pod a session is placed on, and whether it is returning."""
        if session is None:
            return None, False
        with self._lock:
            s = self._sessions.get(session)
            return (None, False) if s is None else (s.pod, s.requests >= 2)

    def place(self, prompt: SessionPrompt, pod: PodId) -> Placement:
        """Bind the session of a request picked for ``pod`` (a new one if it continues
        none) to ``pod``; its tip becomes the request's."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            found = self._find(prompt)
            if found is None:
                found = self._new(prompt.session_key, now)
            s = self._sessions[found]
            moved_from = s.pod if s.pod is not None and s.pod != pod else None
            if s.requests >= 2 and s.pod is not None:
                self._returning[s.pod] -= 1
            s.requests += 1
            s.pod, s.last_s = pod, now
            self._returning[pod] = self._returning.get(pod, 0) + (s.requests >= 2)
            self._set_tip(found, s, prompt)
            self._sessions.move_to_end(found)
            return Placement(found, s.requests >= 2, moved_from)

    def _set_tip(self, sid: int, s: Session, prompt: SessionPrompt) -> None:
        index = prompt.tip_index()
        if index < 0:
            return
        if s.tip is not None and self._by_tip.get(s.tip) == sid:
            del self._by_tip[s.tip]
        s.tip = int(prompt.keys[index])
        self._by_tip[s.tip] = sid  # a tip two sessions reach is the newer's
        data = prompt.data
        if data is None:
            s.end = s.tail = 0
        else:
            s.end = len(data)
            s.tail = xxhash.xxh3_64_intdigest(data[(index + 1) * prompt.block_size :])

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
            if now - s.last_s <= self.idle_s:
                return
            self._drop(sid)

    def _drop(self, sid: int) -> None:
        s = self._sessions.pop(sid)
        if s.requests >= 2 and s.pod is not None:
            self._returning[s.pod] -= 1
        if s.tip is not None and self._by_tip.get(s.tip) == sid:
            del self._by_tip[s.tip]
        key = self._key_of.pop(sid, None)
        if key is not None and self._by_key.get(key) == sid:
            del self._by_key[key]

    def returning_counts(self, pods: Iterable[PodId]) -> dict[PodId, int]:
        """Live returning sessions placed on each of ``pods``."""
        with self._lock:
            self._expire(self._clock())
            return {pod: self._returning.get(pod, 0) for pod in pods}

    def returning_rows(self, rows: Mapping[PodId, int], num_rows: int) -> np.ndarray:
        """``returning_counts`` per row of a pod table (``rows``: pod -> row)."""
        values = np.zeros(num_rows, dtype=np.float64)
        with self._lock:
            self._expire(self._clock())
            for pod, n in self._returning.items():
                if n and (row := rows.get(pod)) is not None:
                    values[row] = n
        return values

    def forget_pods(self, keep: set[PodId]) -> None:
        """Sessions on pods that are gone are unplaced (placed anew by their next request)."""
        with self._lock:
            for s in self._sessions.values():
                if s.pod is not None and s.pod not in keep:
                    s.pod = None
            self._returning = {pod: n for pod, n in self._returning.items() if pod in keep}
