"""KV-cache events on the wire, as vLLM's ``ZmqEventPublisher`` sends them.

Each message has three ZMQ frames: the topic, an 8-byte big-endian sequence number (per
publisher, from 0), and a msgpack payload ``[ts, [event, ...], data_parallel_rank]``
(vLLM's ``EventBatch`` is ``array_like``). Events come in two layouts:

- ``"map"`` (vLLM since PR #42892, so 0.2x and the 0.32 CPU build): a map tagged by
  ``"type"``, fields by name, ``None``-default fields left out but required ones kept::

      {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": p | None,
       "token_ids": [...], "block_size": 16, "lora_id": id | None, "medium": "GPU",
       "lora_name": name | None, "extra_keys": [[name?, salt?] | None, ...], "group_idx": 0,
       "kv_cache_spec_kind": "full_attention"}
      {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
      {"type": "AllBlocksCleared"}

- ``"array"`` (older vLLM): the tag first, then the fields in declaration order:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.

Block hashes are unsigned 64-bit ints (vLLM's default integer form). As in vLLM, a
concrete endpoint (``tcp://127.0.0.1:5557``) makes the publisher *connect*, so the
subscriber binds; an endpoint with ``*`` or ``::``, or ``ipc://`` / ``inproc://``, binds
(``tcp://127.0.0.1:*``: a free port of its own, which ``endpoint`` then tells), so any
number of subscribers can connect to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgpack
import zmq

from extproc.sim.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

Layout = Literal["map", "array"]
MEDIUM_GPU = "GPU"


def event_to_wire(event: KVCacheEvent, layout: Layout = "map") -> Any:
    """One event as vLLM's msgspec encoder would write it (see the module docstring)."""
    if isinstance(event, BlockStored):
        hashes, tokens = list(event.block_hashes), list(event.token_ids)
        if layout == "array":
            return [
                "BlockStored", hashes, event.parent_block_hash, tokens, event.block_size,
                event.lora_id, MEDIUM_GPU, event.lora_name,
            ]  # fmt: skip
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": tokens,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": MEDIUM_GPU,
            "lora_name": event.lora_name,
            "extra_keys": [list(k) if k is not None else None for k in event.extra_keys],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(event, BlockRemoved):
        hashes = list(event.block_hashes)
        if layout == "array":
            return ["BlockRemoved", hashes, MEDIUM_GPU]
        return {
            "type": "BlockRemoved",
            "block_hashes": hashes,
            "medium": MEDIUM_GPU,
            "group_idx": 0,
        }
    assert isinstance(event, AllBlocksCleared)
    return ["AllBlocksCleared"] if layout == "array" else {"type": "AllBlocksCleared"}


def encode_event_batch(
    ts: float, events: Sequence[KVCacheEvent], layout: Layout = "map", data_parallel_rank: int = 0
) -> bytes:
    """The msgpack payload ``[ts, [events], data_parallel_rank]``."""
    batch = [ts, [event_to_wire(e, layout) for e in events], data_parallel_rank]
    return msgpack.packb(batch)  # type: ignore[no-any-return]


def decode_event_batch(payload: bytes) -> tuple[float, list[Any], int | None]:
    """Inverse of ``encode_event_batch`` for subscribers and tests (events left raw)."""
    ts, events, rank = msgpack.unpackb(payload)
    return ts, events, rank


class ZmqEventPublisher:
    """A PUB socket sending one message per event batch, never blocking the caller.

    Messages beyond the high-water mark are dropped, as ZMQ PUB sockets do; ``seq``
    still advances, so a subscriber sees the gap.
    """

    def __init__(
        self, endpoint: str, topic: str, layout: Layout = "map", hwm: int = 100_000
    ) -> None:
        self.topic = topic
        self.layout: Layout = layout
        self._seq = 0
        self._pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        binds = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
        if binds:
            self._pub.bind(endpoint)
            endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(endpoint)
        self.endpoint = endpoint  # as bound (the port chosen), or as connected to

    def publish(self, ts: float, events: Sequence[KVCacheEvent]) -> None:
        payload = encode_event_batch(ts, events, self.layout)
        frames = (self.topic.encode(), self._seq.to_bytes(8, "big"), payload)
        self._seq += 1
        try:
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # over the high-water mark: dropped, like a slow subscriber's messages

    def close(self) -> None:
        self._pub.close(linger=0)
