"""The KV-events subscriber over real ZMQ sockets on 127.0.0.1: both topologies, sequence
gaps (stale, or replayed from a ROUTER speaking vLLM's replay protocol), restarts,
malformed messages, and the metrics each of them moves."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq
from prometheus_client import CollectorRegistry

from extproc.datalayer.kv_events import (
    EVENTS_PORT_LABEL,
    EventsSettings,
    IndexCollector,
    KvEventsSubscriber,
)
from extproc.pods import RANK_LABEL, Pod, PodId
from extproc.prefix.precise.index import PreciseIndex
from extproc.prefix.precise.keys import chain_keys
from extproc.sim.kv_cache import BlockStored, hash_request_tokens
from extproc.sim.kv_events import ZmqEventPublisher, encode_event_batch
from extproc.sim.launch import free_port
from testkit.kv_publisher import TOPIC, Publisher
from testkit.waiting import wait_until

BS = 4
EVENTS_TIMEOUT_S = 20  # a publisher's events reach the subscriber over ZMQ
POD = Pod(PodId("default", "p0"), "127.0.0.1:8000", frozenset({"m"}))


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value, 0 for a series not yet created; ``pod`` defaults to POD."""
    if name.startswith("extproc_kv_events") and "reason" not in labels:
        labels.setdefault("pod", str(POD.id))
    return registry.get_sample_value(name, labels) or 0.0


class Deltas:
    """How much some counters moved since it was made (probes before it do not count)."""

    def __init__(self, registry: CollectorRegistry, *names: str) -> None:
        self.registry = registry
        self.start = {name: value(registry, name) for name in names}

    def __getitem__(self, name: str) -> float:
        return value(self.registry, name) - self.start[name]


def stored(tokens: list[int]) -> BlockStored:
    hashes = tuple(hash_request_tokens(tokens, BS))
    return BlockStored(hashes, None, tuple(tokens[: len(hashes) * BS]), BS, (None,) * len(hashes))


def cached(index: PreciseIndex, tokens: list[int]) -> int:
    return index.match(POD.id, chain_keys(tokens, BS))[0]


@pytest.fixture
def make_subscriber() -> Iterator[Callable[..., tuple[KvEventsSubscriber, PreciseIndex]]]:
    started: list[KvEventsSubscriber] = []

    def make(
        settings: EventsSettings,
        stale_s: float = 60.0,
        registry: CollectorRegistry | None = None,
    ) -> tuple[KvEventsSubscriber, PreciseIndex]:
        index = PreciseIndex(1000, stale_s=stale_s)
        sub = KvEventsSubscriber(index, settings, registry or CollectorRegistry())
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


RECEIVED = "extproc_kv_events_received_total"
BATCHES = "extproc_kv_events_batches_received_total"
APPLIED = "extproc_kv_events_applied_total"
GAPS = "extproc_kv_events_gaps_total"
STALE = "extproc_kv_events_marked_stale_total"
RESTARTS = "extproc_kv_events_restarts_total"
REPLAY_OK = "extproc_kv_events_replays_total", {"outcome": "ok"}
REPLAY_FAILED = "extproc_kv_events_replays_total", {"outcome": "failed"}


def test_connect_topology_applies_a_pods_events(make_subscriber) -> None:  # type: ignore[no-untyped-def]
    pub, registry = Publisher(), CollectorRegistry()
    try:
        _, index = make_subscriber(EventsSettings("connect", port=pub.port), registry=registry)
        connected(pub, index)
        moved = Deltas(registry, BATCHES, RECEIVED, APPLIED, GAPS, STALE)
        pub.publish(stored(list(range(8))), stored(list(range(100, 104))))
        wait_until(lambda: cached(index, list(range(8))) == 2, EVENTS_TIMEOUT_S)
        assert not index.view(POD.id).stale()
        assert [moved[BATCHES], moved[RECEIVED], moved[APPLIED]] == [1, 2, 2]
        assert moved[GAPS] == moved[STALE] == 0
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


def test_malformed_messages_are_dropped_and_counted_by_reason(make_subscriber) -> None:  # type: ignore[no-untyped-def]
    port, registry = free_port(), CollectorRegistry()
    make_subscriber(EventsSettings("bind", bind=(f"tcp://127.0.0.1:{port}",)), registry=registry)
    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    seq = iter(range(1000))

    def send(payload: bytes, topic: bytes = TOPIC) -> None:
        pub.send_multipart([topic, next(seq).to_bytes(8, "big"), payload])

    def errors(reason: str) -> float:
        return value(registry, "extproc_kv_events_errors_total", reason=reason)

    try:
        deadline = time.monotonic() + 20
        while not value(registry, BATCHES):  # ZMQ's slow joiner
            assert time.monotonic() < deadline, "subscriber never connected"
            send(encode_event_batch(0.0, [stored([9] * BS)]))
            time.sleep(0.1)
        moved = Deltas(registry, BATCHES, RECEIVED, APPLIED)
        pub.send_multipart([TOPIC, b"\0" * 8])
        wait_until(lambda: errors("frames") == 1, EVENTS_TIMEOUT_S)
        send(encode_event_batch(0.0, [stored([9] * BS)]), b"kv@10.9.9.9:8000@m")
        wait_until(lambda: errors("unknown_pod") == 1, EVENTS_TIMEOUT_S)
        send(b"\xc1")  # never valid msgpack
        wait_until(lambda: errors("payload") == 1, EVENTS_TIMEOUT_S)
        bad_size = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1] * BS,
                    "block_size": "four"}  # fmt: skip
        send(msgpack.packb([0.0, [bad_size, {"type": "NotAnEvent"}], 0]))
        wait_until(lambda: errors("event") == 1, EVENTS_TIMEOUT_S)
        # the last two were batches of this pod; only the last decoded, to two unused events
        assert [moved[BATCHES], moved[RECEIVED], moved[APPLIED]] == [2, 2, 0]
        for token in (-1, 2**32):  # no uint32 token id: one bad event, the rest applied
            bad_token = {"type": "BlockStored", "block_hashes": [2], "token_ids": [token] * BS,
                         "block_size": BS}  # fmt: skip
            good = {**bad_token, "block_hashes": [3], "token_ids": [9] * BS}
            send(msgpack.packb([0.0, [bad_token, good], 0]))
        wait_until(lambda: errors("event") == 3, EVENTS_TIMEOUT_S)
        wait_until(lambda: moved[APPLIED] == 2, EVENTS_TIMEOUT_S)
    finally:
        pub.close(0)


def test_a_gap_without_replay_marks_the_pod_stale_then_it_rebuilds(make_subscriber) -> None:  # type: ignore[no-untyped-def]
    pub, registry = Publisher(), CollectorRegistry()
    try:
        settings = EventsSettings("connect", port=pub.port)
        _, index = make_subscriber(settings, stale_s=1.0, registry=registry)
        connected(pub, index)
        moved = Deltas(registry, GAPS, STALE)
        pub.publish(stored([1] * 8))
        wait_until(lambda: cached(index, [1] * 8) == 2, EVENTS_TIMEOUT_S)
        pub.publish(stored([2] * 8), lose=True)
        pub.publish(stored([3] * 8))
        wait_until(lambda: cached(index, [3] * 8) == 2, EVENTS_TIMEOUT_S)
        view = index.view(POD.id)
        assert cached(index, [1] * 8) == 0  # forgotten: it may have been evicted meanwhile
        assert view.stale_until > 0  # was marked stale at the gap
        assert moved[GAPS] == moved[STALE] == 1
        assert value(registry, "extproc_kv_events_replays_total", outcome="failed") == 0
        wait_until(lambda: not index.view(POD.id).stale(), EVENTS_TIMEOUT_S)
        assert registry.get_sample_value("extproc_kv_events_stale_pods") == 0
    finally:
        pub.close()


def test_a_gap_is_filled_from_the_replay_endpoint(make_subscriber) -> None:  # type: ignore[no-untyped-def]
    pub, registry = Publisher(replay=True), CollectorRegistry()
    try:
        settings = EventsSettings("connect", port=pub.port, replay_port=pub.replay_port)
        _, index = make_subscriber(settings, registry=registry)
        connected(pub, index)
        moved = Deltas(registry, GAPS, STALE, APPLIED)
        pub.publish(stored([2] * 8), lose=True)
        pub.publish(stored([3] * 8))
        wait_until(lambda: cached(index, [3] * 8) == 2, EVENTS_TIMEOUT_S)
        assert cached(index, [2] * 8) == 2  # the lost batch came back
        assert cached(index, [9] * BS) == 1
        assert not index.view(POD.id).stale()
        assert value(registry, REPLAY_OK[0], **REPLAY_OK[1]) == 1
        assert value(registry, REPLAY_FAILED[0], **REPLAY_FAILED[1]) == 0
        assert [moved[GAPS], moved[STALE], moved[APPLIED]] == [1, 0, 2]
    finally:
        pub.close()


def test_a_replay_nobody_answers_marks_the_pod_stale(make_subscriber) -> None:  # type: ignore[no-untyped-def]
    pub, registry = Publisher(), CollectorRegistry()  # the pod runs no replay endpoint
    try:
        settings = EventsSettings("connect", port=pub.port, replay_port=free_port(),
                                  replay_timeout_s=0.2)  # fmt: skip
        _, index = make_subscriber(settings, registry=registry)
        connected(pub, index)
        moved = Deltas(registry, GAPS, STALE)
        pub.publish(stored([2] * 8), lose=True)
        pub.publish(stored([3] * 8))
        wait_until(lambda: cached(index, [3] * 8) == 2, EVENTS_TIMEOUT_S)
        assert index.view(POD.id).stale()
        assert cached(index, [9] * BS) == 0  # the view before the gap is forgotten
        assert value(registry, REPLAY_FAILED[0], **REPLAY_FAILED[1]) == 1
        assert value(registry, REPLAY_OK[0], **REPLAY_OK[1]) == 0
        assert moved[GAPS] == moved[STALE] == 1
        assert registry.get_sample_value("extproc_kv_events_stale_pods") == 1
    finally:
        pub.close()


def test_a_restarted_publisher_starts_the_view_empty(make_subscriber) -> None:  # type: ignore[no-untyped-def]
    pub, registry = Publisher(), CollectorRegistry()
    try:
        _, index = make_subscriber(EventsSettings("connect", port=pub.port), registry=registry)
        connected(pub, index)
        pub.publish(stored([1] * 8))
        pub.publish(stored([2] * 8))
        wait_until(lambda: cached(index, [2] * 8) == 2, EVENTS_TIMEOUT_S)
        moved = Deltas(registry, RESTARTS, GAPS, STALE)
        pub.seq = 0  # a new engine process
        pub.publish(stored([3] * 8))
        wait_until(lambda: cached(index, [3] * 8) == 2, EVENTS_TIMEOUT_S)
        assert cached(index, [1] * 8) == 0 and cached(index, [2] * 8) == 0
        assert not index.view(POD.id).stale()
        assert [moved[RESTARTS], moved[GAPS], moved[STALE]] == [1, 0, 0]
    finally:
        pub.close()


def test_the_index_collector_reports_each_views_blocks_orphans_and_overflow() -> None:
    index, registry = PreciseIndex(capacity_blocks=2), CollectorRegistry()
    registry.register(IndexCollector(index))
    full, other = POD.id, PodId("default", "p1")
    tokens = list(range(3 * BS))
    index.stored(full, [1, 2, 3], None, tokens, BS, None)  # 3 blocks, room for 2
    index.stored(full, [7], None, [5] * BS, BS, None, "CPU")
    index.stored(full, [8], 999, [6] * BS, BS, None)  # under a parent it never saw
    index.stored(other, [4], None, [1] * BS, BS, None)
    index.mark_stale(other)

    def get(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert get("extproc_kv_events_blocks", pod="default/p0", medium="GPU") == 2
    assert get("extproc_kv_events_blocks", pod="default/p0", medium="CPU") == 1
    assert get("extproc_kv_events_blocks", pod="default/p1", medium="GPU") is None  # cleared
    assert get("extproc_kv_events_evicted_blocks_total", pod="default/p0") == 1
    assert get("extproc_kv_events_orphan_blocks_total", pod="default/p0") == 1
    assert get("extproc_kv_events_orphan_blocks_total", pod="default/p1") == 0
    assert get("extproc_kv_events_stale_pods") == 1


@pytest.mark.parametrize("labelled", [True, False], ids=["events-port-label", "events-port-flag"])
def test_a_data_parallel_rank_subscribes_at_the_events_port_plus_its_rank(labelled: bool) -> None:
    """vLLM's rank N binds the configured events port + N (``offset_endpoint_port``)."""
    pub = Publisher()
    base = pub.port - 1
    rank1 = Pod(
        PodId("default", "dp-rank-1"),
        "127.0.0.1:8001",
        frozenset({"m"}),
        labels=(((EVENTS_PORT_LABEL, str(base)),) if labelled else ()) + ((RANK_LABEL, "1"),),
    )
    index = PreciseIndex(1000, stale_s=60.0)
    sub = KvEventsSubscriber(index, EventsSettings("connect", port=base), CollectorRegistry())
    sub.set_pods([rank1])
    sub.start()
    try:
        assert sub.ready.wait(10)
        tokens = [7] * BS
        deadline = time.monotonic() + EVENTS_TIMEOUT_S
        while not index.views.get(rank1.id) or not index.match(rank1.id, chain_keys(tokens, BS))[0]:
            assert time.monotonic() < deadline, "rank 1 never heard its publisher"
            pub.seq = 0
            pub.publish(stored(tokens))
            time.sleep(0.1)
    finally:
        sub.stop()
        pub.close()
