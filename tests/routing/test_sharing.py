"""Routers sharing their view through a real ``redis-server`` (started on a free port):
convergence, no echo, Redis killed and restarted, a late replica catching up; one
replica's picks credited and counted in flight on another until their end."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import orjson
import pytest
import redis
from prometheus_client import CollectorRegistry

from extproc.pods import Pod, PodId
from extproc.request.parse import parse_request
from extproc.routing.records import Record, Shared, Started
from extproc.routing.router import Router
from extproc.routing.sharing import RedisSharing, encode_shared, encode_started
from extproc.scheduling.config import build_scheduler, default_config_text, parse_config
from extproc.scheduling.interfaces import Cycle
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.wire.access_log import AccessLogHandler
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer
from testkit.factories import make_pod
from testkit.replicas import RedisServer, run_redis
from testkit.waiting import wait_until
from tests.routing.support import GEOMETRY, PODS, log_entry, make_router, process

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with run_redis(tmp_path) as running:
        yield running


def sharing(
    server: RedisServer, make: Callable[..., Router] = make_router, maxlen: int = 1000
) -> tuple[Router, RedisSharing]:
    """A router built to publish through a started ``RedisSharing``, which applies the
    other replicas' entries to it."""
    shared = RedisSharing(server.url, maxlen=maxlen, registry=CollectorRegistry())
    router = make(share=shared.publish)
    shared.start(router)
    return router, shared


def applied(shared: RedisSharing) -> int:
    """Entries applied, starts and ends."""
    return sum(int(c._value.get()) for c in shared.applied.values())


def entries(router: Router, pod: PodId = PODS[1].id) -> int:
    return int(router.scheduler.recorders[0].index.num_pod_entries(pod))  # type: ignore[attr-defined]


def serve(router: Router, request_id: str, prompt: str, pod: int = 1) -> None:
    """Route and complete one request on ``pod`` (served there, recorded)."""
    body = f'{{"model": "m", "prompt": "{prompt}"}}'.encode()
    router.route("/v1/completions", body, request_id=request_id)
    assert router.complete(request_id, PODS[pod].address, succeeded=True)


def test_records_converge_without_echo(server: RedisServer) -> None:
    (a, share_a), (b, share_b) = sharing(server), sharing(server)
    try:
        serve(a, "r1", "tenant one " * 40)
        wait_until(lambda: entries(b) == entries(a) > 0, timeout_s=10)
        serve(b, "r2", "tenant two " * 40)
        wait_until(lambda: entries(a) == entries(b), timeout_s=10)
        wait_until(lambda: share_a.applied["end"]._value.get() == 1, timeout_s=10)
        assert share_b.applied["end"]._value.get() == 1  # each applied the other's only
        client = redis.Redis.from_url(server.url)
        assert client.xlen(share_a.stream) == 4  # a start and an end each, none again
    finally:
        share_a.stop()
        share_b.stop()


def test_redis_down_routing_goes_on_and_sharing_resumes(server: RedisServer) -> None:
    (a, share_a), (b, share_b) = sharing(server), sharing(server)
    try:
        wait_until(lambda: share_a.up._value.get() == share_b.up._value.get() == 1, timeout_s=10)
        server.stop(signal.SIGKILL)
        serve(a, "r1", "during the outage " * 40)  # routes and records locally
        wait_until(lambda: share_a.up._value.get() == 0, timeout_s=10)
        assert entries(b) == 0
        server.start()  # same port, empty: the queued entry goes out, b reads it
        wait_until(lambda: entries(b) == entries(a) > 0, timeout_s=30)
        # b read a's entry once a's writer was back; a's reader may still be backing off.
        wait_until(lambda: share_a.up._value.get() == 1, timeout_s=30)
        assert share_a.dropped._value.get() == 0
    finally:
        share_a.stop()
        share_b.stop()


def test_entries_written_just_before_redis_died_are_written_again(server: RedisServer) -> None:
    """Redis keeps nothing across a kill: what the others had not read yet is resent."""
    a, share_a = sharing(server)
    try:
        serve(a, "r1", "written, then lost with redis " * 40)
        client = redis.Redis.from_url(server.url)
        wait_until(lambda: client.xlen(share_a.stream) == 2, timeout_s=10)  # a start, an end
        server.stop(signal.SIGKILL)
        serve(a, "r2", "during the outage " * 40)
        wait_until(lambda: share_a.up._value.get() == 0, timeout_s=10)
        server.start()  # same port, empty
        wait_until(lambda: client.xlen(share_a.stream) == 4, timeout_s=30)
        b, share_b = sharing(server)  # reads the new stream from its start: both records
        try:
            wait_until(lambda: entries(b) == entries(a) > 0, timeout_s=30)
        finally:
            share_b.stop()
    finally:
        share_a.stop()


def test_a_late_replica_catches_up_from_the_bounded_window(server: RedisServer) -> None:
    a, share_a = sharing(server, maxlen=50)
    try:
        for i in range(400):
            serve(a, f"r{i}", f"prompt {i} " * 20, pod=i % 4)
        client = redis.Redis.from_url(server.url)
        wait_until(lambda: share_a.published["end"]._value.get() == 400, timeout_s=10)
        assert client.xlen(share_a.stream) < 800  # trimmed: about maxlen, by whole nodes
        late, share_late = sharing(server, maxlen=50)
        try:
            window = client.xlen(share_a.stream)
            wait_until(lambda: applied(share_late) == window, timeout_s=10)
            assert 0 < sum(entries(late, p.id) for p in PODS) < sum(entries(a, p.id) for p in PODS)
            serve(a, "after", "after the catch-up " * 20)  # then it follows the tail
            wait_until(lambda: applied(share_late) == window + 2, timeout_s=10)
        finally:
            share_late.stop()
    finally:
        share_a.stop()


def test_malformed_entries_are_counted_and_skipped(server: RedisServer) -> None:
    _, share_a = sharing(server)
    try:
        client = redis.Redis.from_url(server.url)
        client.xadd(share_a.stream, {"o": "x", "r": "r1", "m": "m", "p": "no-slash"})
        client.xadd(share_a.stream, {"r": "r2"})
        client.xadd(share_a.stream, {"o": "x", "r": "r3"})  # a valid end without a record
        wait_until(lambda: share_a.applied["end"]._value.get() == 1, timeout_s=10)
        assert share_a.invalid.labels("pod")._value.get() == 1
        assert share_a.invalid.labels("origin")._value.get() == 1
    finally:
        share_a.stop()


def test_a_router_publishes_from_the_sharings_start_to_its_stop() -> None:
    shared = RedisSharing("redis://127.0.0.1:1", registry=CollectorRegistry())  # unreachable
    router = make_router(share=shared.publish)
    serve(router, "before", "before the start " * 20)
    assert len(shared._queue) == 0
    shared.start(router)
    serve(router, "during", "while sharing " * 20)  # a start and an end, kept for Redis
    wait_until(lambda: len(shared._queue) == 2, timeout_s=10)
    shared.stop()
    serve(router, "after", "after the stop " * 20)
    assert len(shared._queue) == 2


@pytest.mark.parametrize(
    ("url", "logged"),
    [
        pytest.param("redis://:secret@r.infra:6379/0", "redis://r.infra:6379/0", id="password"),
        pytest.param("rediss://user:pw@h:1/2?ssl_cert_reqs=none", "rediss://h:1/2", id="user"),
        pytest.param("redis://h:6379", "redis://h:6379", id="plain"),
    ],
)
def test_log_lines_name_redis_without_its_password(url: str, logged: str) -> None:
    sharing = RedisSharing(url, registry=CollectorRegistry())
    assert sharing.where == logged


PRECISE_PODS = [make_pod(f"p{i}", model="qwen3-tiny", port=8000 + i) for i in range(4)]


def configured_router(
    precise: bool, share: Callable[[Shared | Started], object] | None = None
) -> Router:
    """The default configuration (estimated-ttft), or precise.yaml with qwen3-tiny."""
    registry = CollectorRegistry()
    if precise:
        text = Path("extproc/data/precise.yaml").read_text()
        text = text.replace("/models/qwen3-tiny", str(MODEL_DIR))
    else:
        text = default_config_text()
    scheduler = build_scheduler(parse_config(text, "t.yaml"), registry)
    return Router(scheduler, PRECISE_PODS, registry=registry, carry_records=True, share=share)


def chat(prompt: str) -> bytes:
    message = {"role": "user", "content": prompt}
    return orjson.dumps({"model": "qwen3-tiny", "messages": [message]})


def held(router: Router, body: bytes, pods: Sequence[Pod]) -> dict[PodId, int]:
    """What ``router`` scores each pod as holding of ``body``'s prompt: precise-prefix-
    cache's exact tokens (precise.yaml), else estimated-ttft's blocks (records and picks)."""
    cycle = Cycle(parse_request("/v1/chat/completions", body))
    for plugin in router.scheduler.provisional:
        if isinstance(plugin, PrecisePrefixCache):
            exact = plugin.exact_matches(cycle, pods)
            assert exact is not None
            return {p: n for p, n in exact.matched_tokens.items() if n}
    plugin = next(p for p in router.scheduler.provisional if isinstance(p, EstimatedTTFT))
    return plugin.matched_blocks(cycle, pods)


def arriving(router: Router) -> int:
    """Requests credited as arriving, over the plugins keeping prefix credit (lora-affinity
    is provisional too, with nothing to take back)."""
    return sum(
        p.arrivals.num_requests for p in router.scheduler.provisional if hasattr(p, "arrivals")
    )


@pytest.mark.parametrize(
    "precise",
    [
        pytest.param(False, id="default"),
        pytest.param(True, id="precise", marks=needs_model_tokenizer),
    ],
)
def test_a_pick_is_credited_on_the_other_replica_until_its_end(
    server: RedisServer, precise: bool
) -> None:
    make = partial(configured_router, precise)
    (a, share_a), (b, share_b) = sharing(server, make), sharing(server, make)
    pods = PRECISE_PODS
    try:
        body = chat("a new tenant's long system prompt, " * 60)
        assert held(b, body, pods) == {}
        decision = a.route("/v1/chat/completions", body, request_id="r1")
        pick = decision.pods[0]
        wait_until(lambda: share_b.applied["start"]._value.get() == 1, timeout_s=10)
        # Before any record or KV event: b scores a's pick as holding the prompt.
        assert list(held(b, body, pods)) == [pick.id]
        assert b.route("/v1/chat/completions", body).pods[0] == pick
        assert b.in_flight.get_count(pick.id) == a.in_flight.get_count(pick.id)
        assert b.in_flight.get(pick.id) == 1 and arriving(b) == arriving(a) > 0
        assert a.complete("r1", pick.address, succeeded=True)
        wait_until(lambda: share_b.applied["end"]._value.get() == 1, timeout_s=10)
        assert b.in_flight.get(pick.id) == 0 and len(b.pending) == 0 and arriving(b) == 0
        assert b.metrics.ended_elsewhere._value.get() == 0  # not routed by b
    finally:
        share_a.stop()
        share_b.stop()


def test_a_pick_heard_after_its_end_is_dropped(server: RedisServer) -> None:
    b, share_b = sharing(server)
    try:
        record = Record("m", {GEOMETRY: np.array([1, 2], np.int64)}, None, np.array([5], np.int64))
        client = redis.Redis.from_url(server.url)
        client.xadd(share_b.stream, encode_shared(Shared("a", "late")))  # type: ignore[arg-type]
        for request_id in ("late", "next"):
            started = Started("a", request_id, record, PODS[0].id, 100)
            client.xadd(share_b.stream, encode_started(started))  # type: ignore[arg-type]
        wait_until(lambda: share_b.applied["start"]._value.get() == 1, timeout_s=10)  # "next"
        assert list(b.pending._items) == ["next"] and b.in_flight.get(PODS[0].id) == 1
        unknown = Started("a", "gone", record, PodId("default", "gone"), 100)
        client.xadd(share_b.stream, encode_started(unknown))  # type: ignore[arg-type]
        wait_until(lambda: b.metrics.shared_unknown_pod["start"]._value.get() == 1, timeout_s=10)
        assert share_b.applied["start"]._value.get() == 1 and len(b.pending) == 1
    finally:
        share_b.stop()


def test_an_end_heard_by_a_replica_holding_the_others_pick_is_recorded_once(
    server: RedisServer,
) -> None:
    (a, share_a), (b, share_b) = sharing(server), sharing(server)
    try:
        reply = process(a, "r1")  # a routes, b applies its pick, then hears the end
        wait_until(lambda: len(b.pending) == 1, timeout_s=10)
        pick = next(iter(b.pending._items.values())).pick
        entry = log_entry("r1", PODS[2].address, reply.dynamic_metadata)
        AccessLogHandler(b).complete(entry)
        outcomes = b.metrics.outcome
        assert outcomes["recorded_from_metadata"].value == 1
        assert outcomes["recorded"].value == outcomes["unknown_request"].value == 0
        assert len(b.pending) == 0 and b.in_flight.get(pick) == 0
        wait_until(lambda: share_a.applied["end"]._value.get() == 1, timeout_s=10)
        assert share_b.published["end"]._value.get() == 1  # published once (before a read it)
        assert a.metrics.ended_elsewhere._value.get() == 1
        assert len(a.pending) == 0 and a.in_flight.get(pick) == 0
        assert entries(a, PODS[2].id) == entries(b, PODS[2].id) > 0  # recorded once each
        assert a.metrics.outcome["recorded"].value == 0
    finally:
        share_a.stop()
        share_b.stop()
