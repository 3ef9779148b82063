"""One view across replicas: each replica publishes its picks and the ends it hears of
to a Redis stream and applies the others' (``--redis-url``; off by default).

Two kinds of stream entries (field ``e``):

* ``start``, every pick a replica makes (``routing.records.Started``): the request id,
  the pick (and prefill pod) with its in-flight tokens, and the record with the pick's
  credit keys; the others count it in flight and credit it as arriving until its end
  (``Router.apply_started``), so a burst of one new prefix routed by several replicas
  lands where the first went, as with one replica;
* ``end``, every end a replica hears (Envoy's access log): the request id (whoever
  routed it, or applied its pick, stops counting it in flight) and, when it was
  recorded, the record and the serving pod (``routing.records.Shared``).

The router is built with ``publish`` as its ``share`` (entries are queued from ``start``
to ``stop``); ``start(router)`` runs the threads, and the reader applies the other
replicas' entries through that router's ``Router.apply_started`` and
``Router.apply_shared`` (the scheduler's paths, whose index, arrivals and session store
have their own locks), never publishing them again; a replica's own entries are skipped
by its id.

* Bounded: the stream is trimmed to about ``maxlen`` entries (``XADD MAXLEN ~``); a
  replica that starts reads that window (oldest first) and then follows the tail, so it
  catches up without a replay of history its index could not hold anyway.
* Never in the way: publishing only queues (bounded; the oldest go first); a writer
  thread sends batches. Redis down or unreachable: routing goes on with the local view,
  ``extproc_sharing_up`` is 0 and one log line says so; both threads retry with
  backoff (up to ``MAX_BACKOFF_S``), the queued entries go out and the reader resumes
  after the last entry it applied.

Hand-written on the ``redis`` client rather than a task-queue library: two loops, and
what matters (no echo, bounded memory, resume after the last id) is this module's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from extproc.routing.records import (
    MAX_CREDIT_BLOCKS,
    BadRecord,
    Record,
    Shared,
    Started,
    check_text,
    decode_key_array,
    decode_keys,
    encode_key_array,
    encode_keys,
    parse_pod,
    pod_text,
)
from extproc.routing.router import Router

log = logging.getLogger("extproc.sharing")

DEFAULT_STREAM = "extproc:records"
DEFAULT_MAXLEN = 20_000  # entries kept in Redis, two a request (keys: 1.4 KB per 128)
QUEUE_MAX = 10_000  # entries waiting for Redis; beyond, the oldest are dropped
BATCH = 256  # entries per XADD pipeline / XREAD / catch-up page
READ_BLOCK_MS = 1000
MIN_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
# Entries written this long before the last good write are written again when Redis
# fails: a Redis that died (no persistence) loses what the other replicas had not read
# yet. A duplicate is harmless (the same blocks recorded again; the request ended).
RESEND_WINDOW_S = 5.0


KINDS = ("start", "end")

Entry = tuple[bytes, Mapping[bytes, bytes]]  # a stream entry: its id and fields


def _entries(reply: Any) -> list[Entry]:
    """redis-py's (untyped) list of stream entries, shapes checked."""
    return [
        (entry_id, fields)
        for entry_id, fields in cast(list[Any], reply or [])
        if isinstance(entry_id, bytes) and isinstance(fields, dict)
    ]


def _without_password(url: str) -> str:
    """``url`` with any user and password left out (it goes to logs)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def encode_shared(shared: Shared) -> dict[str, str]:
    """A stream entry's fields (text)."""
    fields = {"o": shared.origin, "r": shared.request_id}
    if shared.record is not None and shared.pod is not None:
        fields["m"] = shared.record.model
        fields["k"] = " ".join(encode_keys(shared.record.keys))
        fields["p"] = pod_text(shared.pod)
        if shared.prefill is not None:
            fields["f"] = pod_text(shared.prefill)
        if shared.record.session_key:
            fields["s"] = shared.record.session_key
    return fields


def encode_started(started: Started) -> dict[str, str]:
    """A start entry's fields (text): an end's, and the kind, tokens and credit keys."""
    record = started.record
    fields = encode_shared(
        Shared(started.origin, started.request_id, record, started.pick, started.prefill)
    )
    fields["e"] = "start"
    fields["n"] = str(started.pick_tokens)
    if started.prefill is not None:
        fields["nf"] = str(started.prefill_pod_tokens)
    if record.credit_keys is not None:
        fields["c"] = encode_key_array(record.credit_keys)
    return fields


def _tokens(text: str, field: str) -> int:
    if not text.isdigit() or len(text) > 12:
        raise BadRecord(field, f"expected a token count, got {text[:40]!r}")
    return int(text)


def decode_entry(
    fields: Mapping[bytes, bytes], geometries: Sequence[tuple[int, int]]
) -> Shared | Started:
    """``encode_shared`` or ``encode_started`` read back (an entry without a kind is an
    end).

    Raises:
        BadRecord: a field is missing or malformed.
    """
    text = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in fields.items()}
    kind = text.get("e", "end")
    if kind not in KINDS:
        raise BadRecord("kind", f"expected start or end, got {kind[:40]!r}")
    origin = check_text(text.get("o", ""), "origin")
    request_id = check_text(text.get("r", ""), "request_id", empty=kind == "end")
    if "p" not in text:
        if kind == "start":
            raise BadRecord("pod", "a start without its pick")
        return Shared(origin, request_id)
    keys = decode_keys(text.get("k", "").split(), geometries)
    session = check_text(text["s"], "session") if "s" in text else None
    model = check_text(text.get("m", ""), "model")
    pod = parse_pod(text["p"])
    prefill = parse_pod(text["f"]) if "f" in text else None
    if kind == "end":
        return Shared(origin, request_id, Record(model, keys, session), pod, prefill)
    credit = decode_key_array(text["c"], MAX_CREDIT_BLOCKS, "credit_keys") if "c" in text else None
    record = Record(model, keys, session, credit)
    pick_tokens = _tokens(text.get("n", ""), "tokens")
    prefill_pod_tokens = _tokens(text["nf"], "tokens") if "nf" in text else 0
    return Started(origin, request_id, record, pod, pick_tokens, prefill, prefill_pod_tokens)


class RedisSharing:
    """Publishes a router's picks and ends to a Redis stream and applies the others'."""

    def __init__(
        self,
        url: str,
        *,
        stream: str = DEFAULT_STREAM,
        maxlen: int = DEFAULT_MAXLEN,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        """Raises ``ValueError`` for a URL the redis client cannot use."""
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self.where = _without_password(url)  # for log lines
        self.stream = stream
        self.maxlen = maxlen
        # Separate connections: the reader blocks in XREAD up to READ_BLOCK_MS.
        options = {"socket_connect_timeout": 1.0, "socket_timeout": 5.0, "retry": None}
        self._writer_client = redis.Redis.from_url(url, **options)
        self._reader_client = redis.Redis.from_url(url, **options)
        self._queue: deque[dict[str, str]] = deque()
        self._recent: deque[tuple[float, dict[str, str]]] = deque(maxlen=QUEUE_MAX)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._publishing = False  # from ``start`` to ``stop``
        self._last_id: bytes | None = None  # the last entry applied; None: catch up first
        self._threads: list[threading.Thread] = []
        self._up = {"writer": True, "reader": False}  # the writer: nothing to write yet
        self._state: bool | None = None  # last logged: up, down, or not yet known
        self._state_lock = threading.Lock()
        self.up = Gauge(
            "extproc_sharing_up",
            "1 while this replica reads and writes the shared Redis stream, else 0 "
            "(routing goes on with the local view).",
            registry=registry,
        )
        published = Counter(
            "extproc_sharing_published",
            "Entries written to the Redis stream, by kind (start: a pick; end).",
            ["kind"],
            registry=registry,
        )
        applied = Counter(
            "extproc_sharing_applied",
            "Other replicas' entries applied from the Redis stream, by kind (start: a pick, "
            "not counted when its end came first or its pod is unknown; end).",
            ["kind"],
            registry=registry,
        )
        self.published = {k: published.labels(k) for k in KINDS}
        self.applied = {k: applied.labels(k) for k in KINDS}
        self.dropped = Counter(
            "extproc_sharing_dropped",
            "Entries never published: the queue was full while Redis was unreachable.",
            registry=registry,
        )
        self.invalid = Counter(
            "extproc_sharing_invalid",
            "Stream entries skipped because they were malformed, by the field at fault.",
            ["reason"],
            registry=registry,
        )
        queued = Gauge(
            "extproc_sharing_queued", "Entries waiting to be written to Redis.", registry=registry
        )
        queued.set_function(lambda: len(self._queue))

    def publish(self, news: Shared | Started) -> None:
        """Queue one pick or end for the others (never blocks; ``Router.share``); nothing
        before ``start`` or after ``stop``."""
        if not self._publishing:
            return
        fields = encode_started(news) if isinstance(news, Started) else encode_shared(news)
        with self._lock:
            self._queue.append(fields)
            if len(self._queue) > QUEUE_MAX:
                self._queue.popleft()
                self.dropped.inc()
        self._wake.set()

    def start(self, router: Router) -> None:
        """Publish what ``router`` (built with ``share=self.publish``) tells, and apply
        the other replicas' entries to it."""
        self._publishing = True
        threads = (
            threading.Thread(target=self._write_loop, name="redis-writer", daemon=True),
            threading.Thread(
                target=self._read_loop, args=(router,), name="redis-reader", daemon=True
            ),
        )
        for thread in threads:
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 3.0) -> None:
        """Stop publishing and both threads (the writer flushes what it can first)."""
        self._publishing = False
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout_s)
        self._writer_client.close()
        self._reader_client.close()

    def _write_loop(self) -> None:
        backoff = MIN_BACKOFF_S
        last_ok_s: float | None = None  # None: in an outage (or nothing written yet)
        while True:
            self._wake.wait(0.5)
            self._wake.clear()
            while self._queue:
                with self._lock:
                    batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
                try:
                    pipe = self._writer_client.pipeline(transaction=False)
                    for fields in batch:
                        pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]
                    pipe.execute()
                except redis.RedisError as exc:
                    with self._lock:  # back in front, still bounded
                        self._queue.extendleft(reversed(batch))
                        if last_ok_s is not None:  # the outage starts: resend the window
                            since_s = last_ok_s - RESEND_WINDOW_S
                            resend = [f for t, f in self._recent if t >= since_s]
                            self._queue.extendleft(reversed(resend))
                            self._recent.clear()
                            last_ok_s = None
                        while len(self._queue) > QUEUE_MAX:
                            self._queue.popleft()
                            self.dropped.inc()
                    self._set_up("writer", False, exc)
                    if self._stop.wait(backoff):
                        return
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                    continue
                num_started = sum(f.get("e") == "start" for f in batch)
                self.published["start"].inc(num_started)
                self.published["end"].inc(len(batch) - num_started)
                last_ok_s = time.monotonic()
                self._recent.extend((last_ok_s, fields) for fields in batch)
                while self._recent[0][0] < last_ok_s - RESEND_WINDOW_S:
                    self._recent.popleft()
                self._set_up("writer", True)
                backoff = MIN_BACKOFF_S
            if self._stop.is_set():
                return

    def _read_loop(self, router: Router) -> None:
        backoff = MIN_BACKOFF_S
        while not self._stop.is_set():
            try:
                if self._last_id is None:
                    self._catch_up(router)
                    self._set_up("reader", True)
                answer = self._reader_client.xread(
                    {self.stream: self._last_id or b"0-0"}, count=BATCH, block=READ_BLOCK_MS
                )
                self._set_up("reader", True)
                backoff = MIN_BACKOFF_S
                for reply in cast(list[Any], answer or []):
                    self._apply(router, _entries(reply[1]))
            except redis.RedisError as exc:
                self._set_up("reader", False, exc)
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _catch_up(self, router: Router) -> None:
        """Apply the stream's window, oldest first (bounded by ``maxlen``)."""
        start = b"-"
        num_applied = 0
        while not self._stop.is_set():
            entries = _entries(self._reader_client.xrange(self.stream, start, "+", count=BATCH))
            if not entries:
                break
            num_applied += self._apply(router, entries)
            start = b"(" + entries[-1][0]
        if self._last_id is None:
            self._last_id = b"0-0"
        log.info("caught up from redis stream %s: %d entries applied", self.stream, num_applied)

    def _apply(self, router: Router, entries: Sequence[Entry]) -> int:
        """Apply the other replicas' entries; returns how many were applied."""
        num_applied = 0
        for entry_id, fields in entries:
            self._last_id = entry_id
            if fields.get(b"o", b"").decode(errors="replace") == router.replica_id:
                continue
            try:
                news = decode_entry(fields, router.geometries)
            except BadRecord as exc:
                self.invalid.labels(exc.reason).inc()
                log.warning("redis stream entry %s skipped: %s", entry_id.decode(), exc)
                continue
            try:
                if isinstance(news, Started):
                    if not router.apply_started(news):
                        continue
                    self.applied["start"].inc()
                else:
                    router.apply_shared(news)
                    self.applied["end"].inc()
            except Exception:
                log.exception("applying redis stream entry %s", entry_id.decode())
                continue
            num_applied += 1
        return num_applied

    def _set_up(self, side: str, up: bool, error: Exception | None = None) -> None:
        """Track both sides; one log line each time sharing stops or resumes."""
        with self._state_lock:  # the two threads report
            self._up[side] = up
            now_up = all(self._up.values())
            self.up.set(1 if now_up else 0)
            if now_up == self._state or (not now_up and error is None):
                return
            self._state = now_up
        if now_up:
            log.info("sharing the view through redis %s stream %s", self.where, self.stream)
        else:
            log.warning(
                "redis %s unreachable (%s): routing goes on with the local view; retrying",
                self.where,
                error,
            )
