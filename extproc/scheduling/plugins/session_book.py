"""Which conversation a request continues, and where each live conversation is placed.

A *session* is a conversation: the requests carrying one session key (the configured
session header), or, without one, a chain of prompts each extending an earlier one (a
chat resends its history, so its next prompt starts with the previous one). A prompt's
*tip* is the key of its last whole block (a partial last block changes as the prompt
grows). A request continues the session whose latest tip is one of its own block keys
before its own tip (the deepest found): it grew by at least a block; its own tip then
replaces that one. A prompt no tip matches starts a new session. A tip two sessions
reach (short prompts ending inside a shared system prompt) belongs to none: it is
forgotten, and ``shared_tips`` of them are remembered as such.

A session is *returning* once it has sent a second request: only returning sessions
count towards a pod's load, so one-shot requests that share a system prompt (tenants of
an application) are not taken for conversations about to grow. A session stays live
``idle_s`` after its latest request; the book keeps at most ``max_sessions`` (least
recently used dropped first), so memory stays bounded whatever clients send.

``place`` binds a session to the pod picked for its request: a session picked elsewhere
than the pod of its previous request has *moved* (counted, with the tokens of history it recomputes).
Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from extproc.pods import PodId
from extproc.prefix.hashing import Keys


@dataclass(slots=True)
class Session:
    pod: PodId | None
    tip: int | None  # its latest prompt's last block key (None: keyed by header only)
    requests: int
    last_s: float


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
        self._shared: OrderedDict[int, None] = OrderedDict()
        self._by_key: dict[str, int] = {}
        self._key_of: dict[int, str] = {}
        self._returning: dict[PodId, int] = {}  # live returning sessions per pod
        self._next_id = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def find(self, keys: Keys, tip_index: int, session_key: str | None = None) -> int | None:
        """The session a request continues: its block ``keys``, the index of its last
        whole block in them (``tip_index``), its session header."""
        with self._lock:
            self._expire(self._clock())
            return self._find(keys, tip_index, session_key)

    def _find(self, keys: Keys, tip_index: int, session_key: str | None) -> int | None:
        if session_key is not None:
            return self._by_key.get(session_key)
        by_tip = self._by_tip
        if by_tip and tip_index > 0:
            for key in keys[tip_index - 1 :: -1].tolist():
                found = by_tip.get(key)
                if found is not None:
                    return found
        return None

    def session_pod(self, session: int | None) -> tuple[PodId | None, bool]:
        """The pod a session is placed on, and whether it is returning."""
        if session is None:
            return None, False
        with self._lock:
            s = self._sessions.get(session)
            return (None, False) if s is None else (s.pod, s.requests >= 2)

    def place(
        self, keys: Keys, tip_index: int, pod: PodId, session_key: str | None = None
    ) -> Placement:
        """Bind the session of a request picked for ``pod`` (a new one if it continues
        none) to ``pod``; its tip becomes the request's (``find``'s arguments)."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            found = self._find(keys, tip_index, session_key)
            tip = int(keys[tip_index]) if 0 <= tip_index < len(keys) else None
            if tip is not None and tip in self._shared:
                tip = None
            if found is None:
                found = self._new(session_key, tip, now)
            s = self._sessions[found]
            was_returning = s.requests >= 2
            moved_from = s.pod if s.pod is not None and s.pod != pod else None
            if was_returning and s.pod is not None:
                self._returning[s.pod] -= 1
            s.requests += 1
            s.pod, s.last_s = pod, now
            self._returning[pod] = self._returning.get(pod, 0) + (s.requests >= 2)
            if tip is not None and tip != s.tip:
                if s.tip is not None and self._by_tip.get(s.tip) == found:
                    del self._by_tip[s.tip]
                s.tip = tip
                other = self._by_tip.setdefault(tip, found)
                if other != found:  # two sessions reached it: a shared block, nobody's tip
                    del self._by_tip[tip]
                    self._shared[tip] = None
                    if len(self._shared) > self.max_sessions:
                        self._shared.popitem(last=False)
            self._sessions.move_to_end(found)
            return Placement(found, s.requests >= 2, moved_from)

    def _new(self, session_key: str | None, tip: int | None, now: float) -> int:
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
