"""Routers sharing their view through a real ``redis-server`` (started on a free port):
convergence, no echo, Redis killed and restarted, a late replica catching up."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from extproc.routing.router import Router
from extproc.routing.sharing import RedisSharing
from extproc.sim.replicas import RedisServer, run_redis, wait_until_true
from extproc.types import PodId
from tests.test_replicas import PODS, make_router

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with run_redis(tmp_path) as running:
        yield running


def sharing(router: Router, server: RedisServer, maxlen: int = 1000) -> RedisSharing:
    shared = RedisSharing(router, server.url, maxlen=maxlen, registry=CollectorRegistry())
    shared.start()
    return shared


def entries(router: Router, pod: PodId = PODS[1].id) -> int:
    return int(router.scheduler.recorders[0].index.num_pod_entries(pod))  # type: ignore[attr-defined]


def serve(router: Router, request_id: str, prompt: str, pod: int = 1) -> None:
    """Route and complete one request on ``pod`` (served there, recorded)."""
    body = f'{{"model": "m", "prompt": "{prompt}"}}'.encode()
    router.route("/v1/completions", body, request_id=request_id)
    assert router.complete(request_id, PODS[pod].address, succeeded=True)


def test_records_converge_without_echo(server: RedisServer) -> None:
    a, b = make_router(), make_router()
    share_a, share_b = sharing(a, server), sharing(b, server)
    try:
        serve(a, "r1", "tenant one " * 40)
        assert wait_until_true(lambda: entries(b) == entries(a) > 0)
        serve(b, "r2", "tenant two " * 40)
        assert wait_until_true(lambda: entries(a) == entries(b))
        assert wait_until_true(lambda: share_a.applied._value.get() == 1)
        assert share_b.applied._value.get() == 1  # each applied the other's only
        client = redis.Redis.from_url(server.url)
        assert client.xlen(share_a.stream) == 2  # applied entries were not published again
    finally:
        share_a.stop()
        share_b.stop()


def test_redis_down_routing_goes_on_and_sharing_resumes(server: RedisServer) -> None:
    a, b = make_router(), make_router()
    share_a, share_b = sharing(a, server), sharing(b, server)
    try:
        assert wait_until_true(lambda: share_a.up._value.get() == share_b.up._value.get() == 1)
        server.stop(signal.SIGKILL)
        serve(a, "r1", "during the outage " * 40)  # routes and records locally
        assert wait_until_true(lambda: share_a.up._value.get() == 0)
        assert entries(b) == 0
        server.start()  # same port, empty: the queued entry goes out, b reads it
        assert wait_until_true(lambda: entries(b) == entries(a) > 0, timeout_s=30)
        # b read a's entry once a's writer was back; a's reader may still be backing off.
        assert wait_until_true(lambda: share_a.up._value.get() == 1, timeout_s=30)
        assert share_a.dropped._value.get() == 0
    finally:
        share_a.stop()
        share_b.stop()


def test_entries_written_just_before_redis_died_are_written_again(server: RedisServer) -> None:
    """Redis keeps nothing across a kill: what the others had not read yet is resent."""
    a = make_router()
    share_a = sharing(a, server)
    try:
        serve(a, "r1", "written, then lost with redis " * 40)
        client = redis.Redis.from_url(server.url)
        assert wait_until_true(lambda: client.xlen(share_a.stream) == 1)
        server.stop(signal.SIGKILL)
        serve(a, "r2", "during the outage " * 40)
        assert wait_until_true(lambda: share_a.up._value.get() == 0)
        server.start()  # same port, empty
        assert wait_until_true(lambda: client.xlen(share_a.stream) == 2, timeout_s=30)
        b = make_router()  # reads the new stream from its start: both records
        share_b = sharing(b, server)
        try:
            assert wait_until_true(lambda: entries(b) == entries(a) > 0, timeout_s=30)
        finally:
            share_b.stop()
    finally:
        share_a.stop()


def test_a_late_replica_catches_up_from_the_bounded_window(server: RedisServer) -> None:
    a = make_router()
    share_a = sharing(a, server, maxlen=50)
    try:
        for i in range(400):
            serve(a, f"r{i}", f"prompt {i} " * 20, pod=i % 4)
        client = redis.Redis.from_url(server.url)
        assert wait_until_true(lambda: share_a.published._value.get() == 400)
        assert client.xlen(share_a.stream) < 400  # trimmed: about maxlen, by whole nodes
        late = make_router()
        share_late = sharing(late, server, maxlen=50)
        try:
            window = client.xlen(share_a.stream)
            assert wait_until_true(lambda: share_late.applied._value.get() == window)
            assert 0 < sum(entries(late, p.id) for p in PODS) < sum(entries(a, p.id) for p in PODS)
            serve(a, "after", "after the catch-up " * 20)  # then it follows the tail
            assert wait_until_true(lambda: share_late.applied._value.get() == window + 1)
        finally:
            share_late.stop()
    finally:
        share_a.stop()


def test_malformed_entries_are_counted_and_skipped(server: RedisServer) -> None:
    a = make_router()
    share_a = sharing(a, server)
    try:
        client = redis.Redis.from_url(server.url)
        client.xadd(share_a.stream, {"o": "x", "r": "r1", "m": "m", "p": "no-slash"})
        client.xadd(share_a.stream, {"r": "r2"})
        client.xadd(share_a.stream, {"o": "x", "r": "r3"})  # a valid end without a record
        assert wait_until_true(lambda: share_a.applied._value.get() == 1)
        assert share_a.invalid.labels("pod")._value.get() == 1
        assert share_a.invalid.labels("origin")._value.get() == 1
    finally:
        share_a.stop()


@pytest.mark.parametrize(
    ("url", "logged"),
    [
        pytest.param("redis://:secret@r.infra:6379/0", "redis://r.infra:6379/0", id="password"),
        pytest.param("rediss://user:pw@h:1/2?ssl_cert_reqs=none", "rediss://h:1/2", id="user"),
        pytest.param("redis://h:6379", "redis://h:6379", id="plain"),
    ],
)
def test_log_lines_name_redis_without_its_password(url: str, logged: str) -> None:
    sharing = RedisSharing(make_router(), url, registry=CollectorRegistry())
    assert sharing.where == logged
