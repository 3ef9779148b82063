"""A restarted extproc's precise view seeded from the view snapshot, with a fake pod
publisher over real ZMQ on 127.0.0.1: the seeded blocks score at once; a replay of the
batches published while extproc was down confirms them; without one they stay
provisional (scored, not exact) until a store confirms or a removal drops each, the
bound expires them, or the pod clears its cache or restarts its publisher."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from extproc.datalayer.kv_events import EventsSettings, KvEventsSubscriber
from extproc.prefix.precise.index import PreciseIndex
from extproc.prefix.precise.keys import chain_keys
from extproc.prefix.snapshot import PreciseView, ViewSnapshot
from extproc.sim.kv_cache import AllBlocksCleared, BlockRemoved, hash_request_tokens
from extproc.sim.kv_events import encode_event_batch
from extproc.sim.launch import free_port
from testkit.kv_publisher import Publisher
from testkit.waiting import wait_until
from tests.datalayer.test_kv_events import BS, EVENTS_TIMEOUT_S, POD, connected, stored

PLUGIN = "precise-prefix-cache"
WARM = [1] * 8, [2] * 8  # two prompts of two blocks each, cached before the restart
MISSED = [3] * 8  # cached while extproc is down


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def removed(tokens: list[int]) -> BlockRemoved:
    return BlockRemoved(tuple(hash_request_tokens(tokens, BS)))


@dataclass
class Restarted:
    """extproc after the restart: its index, subscriber and metrics."""

    index: PreciseIndex
    sub: KvEventsSubscriber
    registry: CollectorRegistry

    def cached(self, tokens: list[int]) -> int:
        return self.index.match(POD.id, chain_keys(tokens, BS))[0]

    def provisional(self, tokens: list[int]) -> bool:
        return self.index.provisional_in(POD.id, chain_keys(tokens, BS))

    def metric(self, name: str, **labels: str) -> float:
        return sample(self.registry, name, **labels)


def view(index: PreciseIndex, sub: KvEventsSubscriber) -> PreciseView:
    return PreciseView(PLUGIN, index, sub.next_sequences, sub.resume)


class Stack:
    """A pod's publisher, an extproc subscribed to it, and the snapshot it drains to."""

    def __init__(self, path: Path, replay: bool) -> None:
        self.path = path
        self.pub = Publisher(replay=replay)
        port = self.pub.replay_port if replay else None
        self.settings = EventsSettings("connect", port=self.pub.port, replay_port=port,
                                       replay_timeout_s=1.0)  # fmt: skip
        self.subs: list[KvEventsSubscriber] = []

    def subscriber(
        self,
        registry: CollectorRegistry,
        provisional_s: float = 600.0,
        settings: EventsSettings | None = None,
    ) -> tuple[PreciseIndex, KvEventsSubscriber]:
        index = PreciseIndex(1000, stale_s=60.0, provisional_s=provisional_s)
        sub = KvEventsSubscriber(index, settings or self.settings, registry)
        sub.set_pods([POD])
        self.subs.append(sub)
        return index, sub

    def warm_then_drain(self, missed: bool = True) -> None:
        """extproc runs, the pod caches WARM, extproc drains and writes its snapshot;
        then the pod publishes a batch (``MISSED``) nobody hears, unless not ``missed``."""
        index, sub = self.subscriber(CollectorRegistry())
        sub.start()
        assert sub.ready.wait(10)
        connected(self.pub, index)
        self.pub.publish(*(stored(t) for t in WARM))
        wait_until(lambda: all(index.match(POD.id, chain_keys(t, BS))[0] == 2 for t in WARM),
                   EVENTS_TIMEOUT_S)  # fmt: skip
        sub.stop()
        written = ViewSnapshot(self.path, 3600, CollectorRegistry(), time.time).write(
            [], [view(index, sub)]
        )
        assert written == 5  # the probe's block and WARM's four
        self.saved_seq = self.pub.seq
        if missed:
            self.pub.publish(stored(MISSED))

    def restart(
        self, provisional_s: float = 600.0, settings: EventsSettings | None = None
    ) -> Restarted:
        """extproc starts again: the snapshot seeds its view before the subscriber runs."""
        registry = CollectorRegistry()
        index, sub = self.subscriber(registry, provisional_s, settings)
        snapshot = ViewSnapshot(self.path, 3600, CollectorRegistry(), time.time)
        snapshot.load([], {POD.id}, [view(index, sub)])
        return Restarted(index, sub, registry)

    def first_batch(self, extproc: Restarted, *tokens: list[int]) -> None:
        """Start the subscriber and publish until a batch arrives (ZMQ's slow joiner
        drops the first ones: a gap)."""
        extproc.sub.start()
        assert extproc.sub.ready.wait(10)
        probe = iter(range(100, 10_000))

        def arrived() -> bool:
            self.pub.publish(stored([next(probe)] * BS), *(stored(t) for t in tokens))
            time.sleep(0.1)
            return extproc.metric("extproc_kv_events_batches_received_total", pod=str(POD.id)) > 0

        wait_until(arrived, EVENTS_TIMEOUT_S)

    def close(self) -> None:
        for sub in self.subs:
            sub.stop()
        self.pub.close()


@pytest.fixture(params=[False, True], ids=["no-replay", "replay"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path / "view.npz", replay=request.param)
    try:
        s.warm_then_drain()
        yield s
    finally:
        s.close()


@pytest.fixture
def no_replay(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path / "view.npz", replay=False)
    try:
        s.warm_then_drain()
        yield s
    finally:
        s.close()


def test_the_seeded_view_scores_at_once_provisional(stack: Stack) -> None:
    """Before any event: the pod holds WARM, not yet confirmed, and the subscriber
    expects the batch after the last one seen before the drain."""
    extproc = stack.restart()
    assert [extproc.cached(t) for t in WARM] == [2, 2]
    assert all(extproc.provisional(t) for t in WARM)
    assert not extproc.index.view(POD.id).stale()
    assert extproc.sub.next_sequences() == {POD.id: stack.saved_seq}
    assert extproc.metric("extproc_kv_events_seeded_blocks_total") == 5
    assert extproc.metric("extproc_kv_events_provisional_blocks") == 5


def test_a_replay_of_the_missed_batches_confirms_the_seeded_view(tmp_path: Path) -> None:
    s = Stack(tmp_path / "view.npz", replay=True)
    try:
        s.warm_then_drain()
        extproc = s.restart()
        s.first_batch(extproc)
        wait_until(lambda: extproc.cached(MISSED) == 2, EVENTS_TIMEOUT_S)  # replayed
        assert [extproc.cached(t) for t in WARM] == [2, 2]
        assert not any(extproc.provisional(t) for t in WARM)
        assert extproc.metric("extproc_kv_events_confirmed_blocks_total") == 5
        assert extproc.metric("extproc_kv_events_provisional_blocks") == 0
        assert extproc.metric("extproc_kv_events_replays_total", pod=str(POD.id), outcome="ok") == 1
    finally:
        s.close()


def test_without_replay_the_seeded_blocks_stay_provisional_and_events_settle_them(
    no_replay: Stack,
) -> None:
    """The gap cannot be filled: the view is not forgotten (nor stale), its blocks stay
    provisional; a store of one confirms it, a removal drops it."""
    s = no_replay
    extproc = s.restart()
    s.first_batch(extproc)
    assert extproc.metric("extproc_kv_events_gaps_total", pod=str(POD.id)) == 1
    assert extproc.metric("extproc_kv_events_marked_stale_total", pod=str(POD.id)) == 0
    assert not extproc.index.view(POD.id).stale()
    assert [extproc.cached(t) for t in WARM] == [2, 2]
    assert all(extproc.provisional(t) for t in WARM)
    s.pub.publish(stored(WARM[0]))  # the pod computed WARM[0] again: confirmed
    wait_until(lambda: not extproc.provisional(WARM[0]), EVENTS_TIMEOUT_S)
    assert extproc.cached(WARM[0]) == 2
    assert extproc.metric("extproc_kv_events_confirmed_blocks_total") == 2
    s.pub.publish(removed(WARM[1]))  # evicted: known by its engine hash
    wait_until(lambda: extproc.cached(WARM[1]) == 0, EVENTS_TIMEOUT_S)
    assert (
        extproc.metric("extproc_kv_events_provisional_dropped_blocks_total", reason="removed") == 2
    )
    s.pub.publish(removed(WARM[0]))  # a confirmed block's removal: not a seeded drop
    wait_until(lambda: extproc.cached(WARM[0]) == 0, EVENTS_TIMEOUT_S)
    assert (
        extproc.metric("extproc_kv_events_provisional_dropped_blocks_total", reason="removed") == 2
    )
    assert extproc.metric("extproc_kv_events_provisional_blocks") == 1  # the probe's


def test_unconfirmed_seeded_blocks_expire_after_the_bound(no_replay: Stack) -> None:
    s = no_replay
    seeded = time.monotonic()
    extproc = s.restart(provisional_s=2.0)
    s.first_batch(extproc, WARM[0])  # confirms WARM[0]
    if time.monotonic() - seeded < 1.9:  # (the first batch may take longer to arrive)
        assert extproc.cached(WARM[1]) == 2
    wait_until(lambda: extproc.cached(WARM[1]) == 0, EVENTS_TIMEOUT_S)
    assert time.monotonic() - seeded >= 2.0
    assert extproc.cached(WARM[0]) == 2
    assert extproc.metric("extproc_kv_events_confirmed_blocks_total") == 2
    assert (
        extproc.metric("extproc_kv_events_provisional_dropped_blocks_total", reason="expired") == 3
    )
    assert extproc.metric("extproc_kv_events_provisional_blocks") == 0


@pytest.mark.parametrize("reason", ["cleared", "restarted"])
def test_a_cleared_cache_or_a_restarted_publisher_drops_the_seeded_view(
    no_replay: Stack, reason: str
) -> None:
    s = no_replay
    extproc = s.restart()
    s.first_batch(extproc)
    if reason == "cleared":
        s.pub.publish(AllBlocksCleared())
    else:
        s.pub.seq = 0  # a new engine process
        s.pub.publish(stored([4] * BS))
    wait_until(lambda: extproc.cached(WARM[0]) == 0, EVENTS_TIMEOUT_S)
    assert extproc.cached(WARM[1]) == 0
    got = extproc.metric("extproc_kv_events_provisional_dropped_blocks_total", reason=reason)
    assert got == 5
    assert extproc.metric("extproc_kv_events_provisional_blocks") == 0


def test_a_publisher_restarted_while_extproc_was_down_drops_the_seeded_view(
    no_replay: Stack,
) -> None:
    """Its sequence numbers start again below the saved one."""
    s = no_replay
    s.pub.seq = 0
    extproc = s.restart()
    s.first_batch(extproc)
    assert [extproc.cached(t) for t in WARM] == [0, 0]
    got = extproc.metric("extproc_kv_events_provisional_dropped_blocks_total", reason="restarted")
    assert got == 5


def test_a_first_batch_that_follows_the_saved_sequence_confirms_the_view(tmp_path: Path) -> None:
    """Nothing was published while extproc was down: the view is exact at once. (Driven
    without ZMQ: its slow joiner may drop the first batch, which is a gap.)"""
    s = Stack(tmp_path / "view.npz", replay=False)
    try:
        s.warm_then_drain(missed=False)
        extproc = s.restart()
        extproc.sub._on_message(POD.id, s.saved_seq, encode_event_batch(0.0, [stored([5] * BS)]))
        assert not any(extproc.provisional(t) for t in WARM)
        assert extproc.metric("extproc_kv_events_confirmed_blocks_total") == 5
        assert extproc.metric("extproc_kv_events_gaps_total", pod=str(POD.id)) == 0
    finally:
        s.close()


def test_a_later_gap_forgets_the_view_as_before(no_replay: Stack) -> None:
    """Only the gap of the restart keeps the seeded blocks: a later one marks the view
    stale, as without a snapshot."""
    s = no_replay
    extproc = s.restart(settings=EventsSettings("connect", port=s.pub.port,
                                                replay_port=free_port(), replay_timeout_s=0.2))  # fmt: skip
    s.first_batch(extproc)
    assert extproc.cached(WARM[0]) == 2
    s.pub.publish(stored([6] * 8), lose=True)
    s.pub.publish(stored([7] * 8))
    wait_until(lambda: extproc.cached([7] * 8) == 2, EVENTS_TIMEOUT_S)
    assert extproc.index.view(POD.id).stale()
    assert extproc.metric("extproc_kv_events_provisional_dropped_blocks_total", reason="stale") == 5
