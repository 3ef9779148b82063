"""The KV-events subscriber over real ZMQ sockets on 127.0.0.1: both topologies, sequence
gaps (stale, or replayed from a ROUTER speaking vLLM's replay protocol), restarts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq
from prometheus_client import CollectorRegistry

from extproc.datalayer.kv_events import EventsSettings, KvEventsSubscriber
from extproc.prefix.precise.index import PreciseIndex
from extproc.prefix.precise.keys import chain_keys
from extproc.sim.kv_cache import BlockStored, hash_request_tokens
from extproc.sim.kv_events import ZmqEventPublisher, encode_event_batch
from extproc.sim.launch import free_port
from extproc.types import Pod, PodId

BS = 4
POD = Pod(PodId("default", "p0"), "127.0.0.1:8000", frozenset({"m"}))


def wait_until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def stored(tokens: list[int]) -> BlockStored:
    hashes = tuple(hash_request_tokens(tokens, BS))
    return BlockStored(hashes, None, tuple(tokens[: len(hashes) * BS]), BS, (None,) * len(hashes))


def cached(index: PreciseIndex, tokens: list[int]) -> int:
    return index.match(POD.id, chain_keys(tokens, BS))[0]


class Publisher:
    """A pod's PUB socket, bound on 127.0.0.1 (the connect topology), numbering batches
    as vLLM does; keeps every batch for an optional replay ROUTER (vLLM's protocol)."""

    def __init__(self, replay: bool = False) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.port, self.seq, self.sent = free_port(), 0, list[tuple[int, bytes]]()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.replay_port = free_port() if replay else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def publish(self, *events: BlockStored, lose: bool = False) -> None:
        payload = encode_event_batch(0.0, events)
        self.sent.append((self.seq, payload))
        if not lose:
            self.pub.send_multipart([b"kv@127.0.0.1:8000@m", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            for seq, payload in self.sent:
                if seq >= int.from_bytes(start, "big"):
                    self.router.send_multipart([client, b"", b"t", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart(
                [client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self.router.close(0)
        self.pub.close(0)


@pytest.fixture
def make_subscriber() -> Iterator[Callable[..., tuple[KvEventsSubscriber, PreciseIndex]]]:
    started: list[KvEventsSubscriber] = []

    def make(
        settings: EventsSettings, stale_s: float = 60.0
    ) -> tuple[KvEventsSubscriber, PreciseIndex]:
        index = PreciseIndex(1000, stale_s=stale_s)
        sub = KvEventsSubscriber(index, settings, CollectorRegistry())
        sub.set_pods([POD])
        sub.start()
        started.append(sub)
        assert sub.ready.wait(10)
        return sub, index

    yield make
    for sub in started:
        sub.stop()


def connected(pub: Publisher, index: PreciseIndex) -> None:
    """ZMQ's slow joiner: publish probes until one arrives (seq 0 then starts the view)."""
    deadline = time.monotonic() + 20
    while not index.views.get(POD.id) or not cached(index, [9] * BS):
        assert time.monotonic() < deadline, "subscriber never connected"
        pub.seq = 0
        pub.sent.clear()
        pub.publish(stored([9] * BS))
        time.sleep(0.1)


def test_connect_topology_applies_a_pods_events(make_subscriber) -> None:  # type: ignore[no-untyped-def]
    pub = Publisher()
    try:
        _, index = make_subscriber(EventsSettings("connect", port=pub.port))
        connected(pub, index)
        pub.publish(stored(list(range(8))))
        wait_until(lambda: cached(index, list(range(8))) == 2)
        assert not index.view(POD.id).stale()
    finally:
        pub.close()


def test_bind_topology_names_the_pod_by_topic(make_subscriber) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    _, index = make_subscriber(EventsSettings("bind", bind=(f"tcp://127.0.0.1:{port}",)))
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", "kv@127.0.0.1:8000@m")
    try:
        tokens = list(range(12))
        deadline = time.monotonic() + 20
        while cached(index, tokens) != 3:  # the first batches may go before the connection
            assert time.monotonic() < deadline
            pub.publish(0.0, [stored(tokens)])
            time.sleep(0.1)
    finally:
        pub.close()


def test_a_gap_without_replay_marks_the_pod_stale_then_it_rebuilds(make_subscriber) -> None:  # type: ignore[no-untyped-def]
    pub = Publisher()
    try:
        _, index = make_subscriber(EventsSettings("connect", port=pub.port), stale_s=1.0)
        connected(pub, index)
        pub.publish(stored([1] * 8))
        wait_until(lambda: cached(index, [1] * 8) == 2)
        pub.publish(stored([2] * 8), lose=True)
        pub.publish(stored([3] * 8))
        wait_until(lambda: cached(index, [3] * 8) == 2)
        view = index.view(POD.id)
        assert cached(index, [1] * 8) == 0  # forgotten: it may have been evicted meanwhile
        assert view.stale_until > 0  # was marked stale at the gap
        wait_until(lambda: not index.view(POD.id).stale())
    finally:
        pub.close()


def test_a_gap_is_filled_from_the_replay_endpoint(make_subscriber) -> None:  # type: ignore[no-untyped-def]
    pub = Publisher(replay=True)
    try:
        settings = EventsSettings("connect", port=pub.port, replay_port=pub.replay_port)
        _, index = make_subscriber(settings)
        connected(pub, index)
        pub.publish(stored([2] * 8), lose=True)
        pub.publish(stored([3] * 8))
        wait_until(lambda: cached(index, [3] * 8) == 2)
        assert cached(index, [2] * 8) == 2  # the lost batch came back
        assert cached(index, [9] * BS) == 1
        assert not index.view(POD.id).stale()
    finally:
        pub.close()


def test_a_restarted_publisher_starts_the_view_empty(make_subscriber) -> None:  # type: ignore[no-untyped-def]
    pub = Publisher()
    try:
        _, index = make_subscriber(EventsSettings("connect", port=pub.port))
        connected(pub, index)
        pub.publish(stored([1] * 8))
        pub.publish(stored([2] * 8))
        wait_until(lambda: cached(index, [2] * 8) == 2)
        pub.seq = 0  # a new engine process
        pub.publish(stored([3] * 8))
        wait_until(lambda: cached(index, [3] * 8) == 2)
        assert cached(index, [1] * 8) == 0 and cached(index, [2] * 8) == 0
        assert not index.view(POD.id).stale()
    finally:
        pub.close()
