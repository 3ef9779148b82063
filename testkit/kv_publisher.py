"""A model server's KV-event publisher for tests: vLLM's PUB socket and replay ROUTER
(vLLM's ``ZmqEventPublisher`` protocol), bound on 127.0.0.1, with lost batches on demand."""

from __future__ import annotations

import threading

import zmq

from extproc.sim.kv_cache import KVCacheEvent
from extproc.sim.kv_events import encode_event_batch
from extproc.sim.launch import free_port

TOPIC = b"kv@127.0.0.1:8000@m"


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

    def publish(self, *events: KVCacheEvent, lose: bool = False) -> None:
        payload = encode_event_batch(0.0, events)
        self.sent.append((self.seq, payload))
        if not lose:
            self.pub.send_multipart([TOPIC, self.seq.to_bytes(8, "big"), payload])
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
