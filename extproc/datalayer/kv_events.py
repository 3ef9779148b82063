"""KV-cache events subscriber: vLLM's ZMQ publishers -> ``PreciseIndex``, on its own thread.

Wire format (vLLM's ``ZmqEventPublisher``): three frames, the topic, an 8-byte
big-endian sequence number per publisher (from 0), and a msgpack ``[ts, [event, ...],
dp_rank]``; each event is a map tagged by ``"type"`` (vLLM 0.2x and later) or an array
with the tag first (older vLLM). Two topologies:

- ``connect``: each pod binds ``tcp://*:PORT``; one SUB socket per known pod connects to
  ``tcp://<pod ip>:<port>`` (the port from the pod label ``EVENTS_PORT_LABEL`` or the
  configured one), so events name their pod by the socket they came on.
- ``bind``: pods connect to extproc's bound SUB socket(s) (vLLM's concrete endpoint),
  and the topic ``kv@<pod ip:port>@<model>`` names the pod by its address.

Sequence numbers are checked per pod. A gap asks the pod's replay endpoint (a ROUTER
socket, vLLM's ``replay_endpoint``) for the missed batches when a replay port is
configured; if that fails, or without one, the pod's view is marked stale (the scorer
uses the approximate view for it) and rebuilt from the next events. A sequence number
below the expected one is a restarted engine: its view starts empty.

A pod whose view was seeded from the view snapshot (``resume``, before ``start``) expects
the sequence number saved with it: a first batch that follows it confirms the seeded
view, a gap is replayed (a full replay confirms it too); where the replay fails or there
is none, the seeded blocks stay provisional (``PreciseIndex``) rather than forgotten, and
only later gaps mark the view stale. A lower number (the publisher restarted while
extproc was down) drops the seeded view.

ZMQ sockets are not thread-safe, so only the subscriber's thread touches them; the pod
list reaches it as a snapshot that it reconciles on its next wake-up.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, NamedTuple, Protocol

import msgpack
import zmq
from prometheus_client import REGISTRY, CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.pods import Pod, PodId

log = logging.getLogger("extproc.kv_events")

Topology = Literal["connect", "bind"]
EVENTS_PORT_LABEL = "extproc.io/kv-events-port"  # a pod's own publisher port, if it differs
END_SEQ = -1  # the replay stream's last message carries this sequence number (signed)
POLL_MS = 100


class ViewCounts(Protocol):
    """One pod's view, as ``IndexCollector`` reads it (``prefix.precise.index.PodView``)."""

    @property
    def blocks(self) -> Mapping[str, Sized]: ...  # medium -> its blocks

    @property
    def orphans(self) -> int: ...

    @property
    def evicted(self) -> int: ...

    def stale(self) -> bool: ...


class EventsIndex(Protocol):
    """What the events are applied to: ``prefix.precise.index.PreciseIndex`` (the
    datalayer knows it by what it does, not by importing the layer above)."""

    @property
    def views(self) -> Mapping[PodId, ViewCounts]: ...

    def stored(
        self,
        pod: PodId,
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: Sequence[Sequence[Any] | None] | None,
        medium: Any = None,
    ) -> object: ...

    def removed(self, pod: PodId, hashes: Sequence[int], medium: Any = None) -> object: ...

    def cleared(self, pod: PodId, reason: str = "cleared") -> None: ...

    def mark_stale(self, pod: PodId) -> None: ...

    def retain_pods(self, keep: Iterable[PodId]) -> None: ...

    def confirm(self, pod: PodId) -> int: ...

    def expire(self, now: float | None = None) -> int: ...

    # seeded blocks (view snapshot): how many, confirmed, dropped by reason, still pending
    @property
    def seeded(self) -> int: ...

    @property
    def confirmed(self) -> int: ...

    @property
    def dropped(self) -> Mapping[str, int]: ...

    @property
    def num_provisional(self) -> int: ...


@dataclass(frozen=True, slots=True)
class EventsSettings:
    topology: Topology = "connect"
    port: int = 5557  # connect: the pods' publisher port
    bind: tuple[str, ...] = ()  # bind: endpoints extproc binds, e.g. tcp://*:5557
    replay_port: int | None = None  # the pods' replay ROUTER port, if they run one
    replay_timeout_s: float = 2.0


def add_events_arguments(p: argparse.ArgumentParser, env: Callable[[str, Any], Any]) -> None:
    """``serve`` flags for the KV-events subscriber (used when the configuration enables
    ``precise-prefix-cache``)."""
    g = p.add_argument_group("KV-cache events", "for the precise-prefix-cache plugin")
    g.add_argument(
        "--kv-events-topology",
        choices=("connect", "bind"),
        default=env("kv-events-topology", "connect"),
        help="connect to each pod's publisher, or bind for pods that connect "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--kv-events-port",
        type=int,
        default=env("kv-events-port", "5557"),
        help="connect: the pods' publisher port, unless a pod's label "
        f"{EVENTS_PORT_LABEL} says otherwise (default: %(default)s)",
    )
    g.add_argument(
        "--kv-events-bind",
        action="append",
        default=None,
        metavar="ENDPOINT",
        help="bind: an endpoint to bind, e.g. tcp://0.0.0.0:5557 (repeatable) (default: none)",
    )
    g.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=env("kv-events-replay-port", None),
        help="the pods' replay endpoint port (vLLM's replay_endpoint), asked after a gap "
        "(default: none: a gap marks the pod's view stale until it is rebuilt)",
    )


def settings_from_args(args: argparse.Namespace) -> EventsSettings:
    """``EventsSettings`` from parsed ``serve`` flags.

    Raises:
        ValueError: a bind topology without an endpoint, or a bad port.
    """
    bind = tuple(args.kv_events_bind or ())
    if args.kv_events_topology == "bind" and not bind:
        raise ValueError("--kv-events-topology bind needs at least one --kv-events-bind")
    for flag in ("kv_events_port", "kv_events_replay_port"):
        port = getattr(args, flag)
        if port is not None and not 0 < int(port) <= 65535:
            raise ValueError(f"--{flag.replace('_', '-')} must be a port 1-65535, got {port}")
    replay = args.kv_events_replay_port
    return EventsSettings(
        args.kv_events_topology,
        int(args.kv_events_port),
        bind,
        int(replay) if replay is not None else None,
    )


def pod_for_topic(topic: bytes, by_address: dict[str, PodId]) -> PodId | None:
    """``kv@<ip:port>@<model>`` -> the pod at that address, if known."""
    parts = topic.decode("utf-8", "replace").split("@")
    return by_address.get(parts[1]) if len(parts) >= 3 and parts[0] == "kv" else None


def decode_batch(payload: bytes) -> list[Any]:
    """The events of one payload; raises ``ValueError`` on a malformed one."""
    try:
        batch = msgpack.unpackb(payload, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 (msgpack raises several unrelated types)
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not an event batch [ts, [events], dp_rank]")
    return batch[1]


def apply_event(index: EventsIndex, pod: PodId, event: Any) -> bool:
    """Apply one event in either layout; False if it is not one we use."""
    if isinstance(event, dict):
        tag = event.get("type")
        get = event.get
    elif isinstance(event, list) and event:
        tag = event[0]
        names = _ARRAY_FIELDS.get(tag, ())
        fields = dict(zip(names, event[1:], strict=False))
        get = fields.get
    else:
        return False
    if get("group_idx") not in (None, 0):  # hybrid models: the full-attention group only
        return False
    if tag == "BlockStored":
        index.stored(
            pod,
            get("block_hashes") or [],
            get("parent_block_hash"),
            get("token_ids") or [],
            int(get("block_size") or 0),
            get("extra_keys"),
            get("medium"),
        )
        return True
    if tag == "BlockRemoved":
        index.removed(pod, get("block_hashes") or [], get("medium"))
        return True
    if tag == "AllBlocksCleared":
        index.cleared(pod)
        return True
    return False


# Older vLLM's array layout: the fields in declaration order after the tag.
_ARRAY_FIELDS: dict[Any, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: Sequence[str]) -> Any:
            return cache(Counter(name, doc, labels, registry=registry).labels)

        self.received = counter(
            "extproc_kv_events_batches_received", "KV-event batches received.", ["pod"]
        )
        self.events = counter(
            "extproc_kv_events_received",
            "KV events received in well-formed batches, applied or not.",
            ["pod"],
        )
        self.applied = counter(
            "extproc_kv_events_applied", "KV events applied to a pod's view.", ["pod"]
        )
        self.gaps = counter(
            "extproc_kv_events_gaps", "Sequence gaps (lost event batches) per pod.", ["pod"]
        )
        self.replays = counter(
            "extproc_kv_events_replays",
            "Replay requests after a gap, by outcome (ok: every missed batch came back).",
            ["pod", "outcome"],
        )
        self.restarts = counter(
            "extproc_kv_events_restarts", "Publishers seen starting again from 0.", ["pod"]
        )
        self.marked_stale = counter(
            "extproc_kv_events_marked_stale",
            "Times a pod's view was forgotten and distrusted for staleSeconds: events were "
            "lost (a gap, or joining a running publisher) and not replayed.",
            ["pod"],
        )
        self.errors = counter(
            "extproc_kv_events_errors",
            "Messages dropped: malformed, or from a publisher naming no known pod.",
            ["reason"],
        )


class IndexCollector(Collector):
    """At scrape time, from each pod's view: blocks per medium, pods whose view is stale,
    and the blocks the view could not key (orphans) or dropped over capacity (its
    counts restart with the view when a pod leaves and comes back); and the blocks seeded
    from the view snapshot: how many, confirmed, still provisional, dropped by reason."""

    def __init__(self, index: EventsIndex) -> None:
        self.index = index

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        blocks = GaugeMetricFamily(
            "extproc_kv_events_blocks",
            "Blocks in a pod's view, by medium (GPU, or an offload tier such as CPU).",
            labels=["pod", "medium"],
        )
        stale = GaugeMetricFamily(
            "extproc_kv_events_stale_pods", "Pods whose view is stale after lost events."
        )
        orphans = CounterMetricFamily(
            "extproc_kv_events_orphan_blocks",
            "Stored blocks whose parent the view does not know (stored before extproc "
            "subscribed, or lost), so they cannot be keyed or matched.",
            labels=["pod"],
        )
        evicted = CounterMetricFamily(
            "extproc_kv_events_evicted_blocks",
            "Blocks dropped because a view passed capacityBlocks: removals were lost.",
            labels=["pod"],
        )
        num_stale = 0
        for pod, view in list(self.index.views.items()):
            label = str(pod)
            num_stale += view.stale()
            for medium, table in list(view.blocks.items()):
                blocks.add_metric([label, medium], len(table))
            orphans.add_metric([label], view.orphans)
            evicted.add_metric([label], view.evicted)
        stale.add_metric([], num_stale)
        return [blocks, stale, orphans, evicted, *self._seeded()]

    def _seeded(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        index = self.index
        seeded = CounterMetricFamily(
            "extproc_kv_events_seeded_blocks",
            "Blocks seeded into the pods' views from the view snapshot at start, "
            "provisional until the pods' events confirm them.",
        )
        seeded.add_metric([], index.seeded)
        confirmed = CounterMetricFamily(
            "extproc_kv_events_confirmed_blocks",
            "Seeded blocks the pods' events confirmed (a replay or an unbroken sequence "
            "confirms them all, a BlockStored of the same key one).",
        )
        confirmed.add_metric([], index.confirmed)
        pending = GaugeMetricFamily(
            "extproc_kv_events_provisional_blocks",
            "Seeded blocks not confirmed yet: scored, but not exact for the cost model.",
        )
        pending.add_metric([], index.num_provisional)
        dropped = CounterMetricFamily(
            "extproc_kv_events_provisional_dropped_blocks",
            "Seeded blocks dropped unconfirmed: expired (provisionalSeconds passed), "
            "removed (BlockRemoved), cleared (AllBlocksCleared), restarted (the publisher "
            "started again from 0), stale (a later gap) or evicted (over capacityBlocks).",
            labels=["reason"],
        )
        for reason, num in dict(index.dropped).items():
            dropped.add_metric([reason], num)
        return [seeded, confirmed, pending, dropped]


class EventsState(NamedTuple):
    """One pod's event stream as the subscriber last saw it (``KvEventsSubscriber.
    pod_states``, for ``/debug/pods``)."""

    next_seq: int | None  # the sequence number expected next; None: none received yet
    last_event_age_s: float | None  # since its last batch was applied; None: never
    gaps: int  # sequence gaps (lost batches)
    replays: int  # gaps and joins recovered by a replay
    marked_stale: int  # times its view was forgotten: events lost and not replayed
    restarts: int  # publisher seen starting again from 0


class KvEventsSubscriber:
    """Keeps ``index`` up to date from the pods' events until ``stop``."""

    def __init__(
        self,
        index: EventsIndex,
        settings: EventsSettings,
        registry: CollectorRegistry = REGISTRY,
        ctx: zmq.Context[Any] | None = None,
    ) -> None:
        self.index = index
        self.settings = settings
        self._ctx = ctx or zmq.Context.instance()
        self._metrics = _Metrics(registry)
        registry.register(IndexCollector(index))
        self._pods: tuple[Pod, ...] = ()
        self._pods_version = 0
        self._seen_version = -1
        self._by_address: dict[str, PodId] = {}
        self._rank: dict[PodId, int] = {}  # a data-parallel rank's offset of its ports
        self._ip: dict[PodId, str] = {}
        self._sockets: dict[PodId, tuple[zmq.Socket[bytes], str]] = {}  # connect topology
        self._bound: list[zmq.Socket[bytes]] = []
        self._next_seq: dict[PodId, int] = {}
        self._seeded: set[PodId] = set()  # resumed from the snapshot, no batch since
        self._applied_at: dict[PodId, float] = {}  # monotonic, for ``pod_states``
        self._tally: dict[tuple[PodId, str], int] = {}  # (pod, gaps|replays|...) -> count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.ready = threading.Event()  # bound (bind topology) and first pods taken

    def set_pods(self, pods: Sequence[Pod]) -> None:
        """The known pods are now ``pods`` (any thread)."""
        self._pods = tuple(pods)
        self._pods_version += 1

    def resume(self, pod: PodId, next_seq: int) -> None:
        """``pod``'s view was seeded from the view snapshot, which saved ``next_seq`` as
        the sequence number it expected next (before ``start``: the thread owns these)."""
        if self._thread.is_alive():
            raise RuntimeError("resume is for before start: the running thread owns the sequences")
        self._next_seq[pod] = next_seq
        self._seeded.add(pod)

    def next_sequences(self) -> dict[PodId, int]:
        """The sequence number each pod's publisher is expected to send next, for the
        view snapshot (after ``stop``)."""
        return dict(self._next_seq)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():  # never started: nothing to wait for
            self._thread.join(timeout_s)

    # The subscriber's thread -----------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        try:
            for endpoint in self.settings.bind if self.settings.topology == "bind" else ():
                sock = self._sub_socket()
                sock.bind(endpoint)
                self._bound.append(sock)
                poller.register(sock, zmq.POLLIN)
            while not self._stop.is_set():
                if self._seen_version != self._pods_version:
                    self._reconcile(poller)
                    self.ready.set()
                for sock, _ in poller.poll(POLL_MS):
                    self._drain(sock)
                self.index.expire()
        except Exception:
            log.exception("the KV-events subscriber stopped")
            raise
        finally:
            for sock in [*self._bound, *(s for s, _ in self._sockets.values())]:
                sock.close(linger=0)

    def _sub_socket(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        return sock

    def _reconcile(self, poller: zmq.Poller) -> None:
        self._seen_version = self._pods_version
        pods = self._pods
        self._by_address = {p.address: p.id for p in pods}
        self._ip = {p.id: p.address.rsplit(":", 1)[0] for p in pods}
        self._rank = {p.id: p.rank or 0 for p in pods}
        self.index.retain_pods(p.id for p in pods)
        for gone in set(self._next_seq) - set(self._ip):
            del self._next_seq[gone]
        self._seeded &= set(self._ip)
        if self.settings.topology != "connect":
            return
        wanted = {p.id: f"tcp://{self._ip[p.id]}:{self._events_port(p)}" for p in pods}
        for pod, (sock, endpoint) in list(self._sockets.items()):
            if wanted.get(pod) != endpoint:
                poller.unregister(sock)
                sock.close(linger=0)
                del self._sockets[pod]
        for pod, endpoint in wanted.items():
            if pod not in self._sockets:
                sock = self._sub_socket()
                sock.connect(endpoint)
                poller.register(sock, zmq.POLLIN)
                self._sockets[pod] = (sock, endpoint)

    def _events_port(self, pod: Pod) -> int:
        """The pod's publisher port plus its rank, as vLLM's data-parallel ranks bind."""
        label = pod.label(EVENTS_PORT_LABEL)
        return (int(label) if label and label.isdigit() else self.settings.port) + (pod.rank or 0)

    def _drain(self, sock: zmq.Socket[bytes]) -> None:
        pod_of_socket = next((p for p, (s, _) in self._sockets.items() if s is sock), None)
        for _ in range(1000):  # bounded, so pod changes and stop are seen in time
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                self._metrics.errors("frames").inc()
                continue
            pod = pod_of_socket or pod_for_topic(frames[0], self._by_address)
            if pod is None:
                self._metrics.errors("unknown_pod").inc()
                continue
            self._on_message(pod, int.from_bytes(frames[1], "big"), frames[2])

    def _on_message(self, pod: PodId, seq: int, payload: bytes) -> None:
        """Sequence check, then apply: see the module docstring."""
        expected = self._next_seq.get(pod)
        label = str(pod)
        seeded = pod in self._seeded  # the first batch since the view was seeded
        self._seeded.discard(pod)
        if expected is None:
            if seq > 0:  # joined a running publisher: what it stored before is unknown
                self._recover(pod, 0, seq)
        elif seq < expected:  # replays apply only batches lost live, so never a duplicate
            self._metrics.restarts(label).inc()
            self._count(pod, "restarts")
            self.index.cleared(pod, "restarted")
            del self._next_seq[pod]
            if seq > 0:
                self._recover(pod, 0, seq)
        elif seq > expected:
            self._metrics.gaps(label).inc()
            self._count(pod, "gaps")
            self._recover(pod, expected, seq, seeded)
        elif seeded:  # nothing was published while extproc was down
            self.index.confirm(pod)
        self._apply(pod, seq, payload)

    def _apply(self, pod: PodId, seq: int, payload: bytes) -> None:
        self._next_seq[pod] = seq + 1
        self._applied_at[pod] = time.monotonic()
        label = str(pod)
        self._metrics.received(label).inc()
        try:
            events = decode_batch(payload)
        except ValueError:
            self._metrics.errors("payload").inc()
            return
        self._metrics.events(label).inc(len(events))
        applied = 0
        for event in events:
            try:
                applied += apply_event(self.index, pod, event)
            # OverflowError: a token id outside uint32's range
            except (TypeError, ValueError, KeyError, OverflowError):
                self._metrics.errors("event").inc()
        if applied:
            self._metrics.applied(label).inc(applied)

    def _recover(self, pod: PodId, first: int, until: int, seeded: bool = False) -> None:
        """Batches ``first``..``until - 1`` were missed: replay them, else go stale (a
        ``seeded`` view stays, provisional)."""
        if self.settings.replay_port is not None and self._replay(pod, first, until):
            self._metrics.replays(str(pod), "ok").inc()
            self._count(pod, "replays")
            if seeded:
                self.index.confirm(pod)
            return
        if self.settings.replay_port is not None:
            self._metrics.replays(str(pod), "failed").inc()
        if seeded:
            log.info("%s: events missed while extproc was down were not replayed; its "
                     "seeded view stays provisional", pod)  # fmt: skip
            return
        self._metrics.marked_stale(str(pod)).inc()
        self._count(pod, "marked_stale")
        self.index.mark_stale(pod)

    def _count(self, pod: PodId, what: str) -> None:
        key = (pod, what)
        self._tally[key] = self._tally.get(key, 0) + 1

    def pod_states(self, pods: Iterable[PodId]) -> dict[PodId, EventsState]:
        """Each pod's stream state (read-only, any thread: reads of dicts the
        subscriber's thread writes, so a value may be one batch old)."""
        now = time.monotonic()
        tally = dict(self._tally)
        out = {}
        for pod in pods:
            at = self._applied_at.get(pod)
            out[pod] = EventsState(
                self._next_seq.get(pod),
                None if at is None else now - at,
                *(tally.get((pod, w), 0) for w in ("gaps", "replays", "marked_stale", "restarts")),
            )
        return out

    def _replay(self, pod: PodId, first: int, until: int) -> bool:
        """Ask the pod's ROUTER for every batch from ``first``; True if all up to
        ``until`` came back in order (they are applied as they come)."""
        assert self.settings.replay_port is not None  # only asked with a replay port
        port = self.settings.replay_port + self._rank.get(pod, 0)
        endpoint = f"tcp://{self._ip.get(pod, '127.0.0.1')}:{port}"
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            timeout_ms = int(self.settings.replay_timeout_s * 1000)
            while sock.poll(timeout_ms):
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    return False
                _, _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return self._next_seq.get(pod, first) == until
                if seq < first or seq >= until:
                    continue
                if seq != self._next_seq.get(pod, first):
                    return False  # the buffer no longer reaches back to ``first``
                self._apply(pod, seq, payload)
            return False
        finally:
            sock.close(linger=0)
