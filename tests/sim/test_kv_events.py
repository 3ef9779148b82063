"""KV-cache events: vLLM's wire layouts, and a subscriber bound to receive a pod's events."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from extproc.sim.kv_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    TokenBlockHash,
    hash_request_tokens,
)
from extproc.sim.kv_events import decode_event_batch, encode_event_batch
from extproc.sim.launch import SimPods
from extproc.sim.pods import GroupSettings, KvEventsSettings
from extproc.sim.tokenizer import tokenize
from testkit.factories import FAST_ENGINE
from testkit.harness import run_sim_pods

H1, H2 = TokenBlockHash(2**64 - 1), TokenBlockHash(7)
STORED = BlockStored((H1, H2), None, tuple(range(8)), 4, (("salt",), None))


def test_map_layout_as_vllm_encodes_it() -> None:
    ts, events, rank = decode_event_batch(
        encode_event_batch(1.5, [STORED, BlockRemoved((H2,)), AllBlocksCleared()])
    )
    assert (ts, rank) == (1.5, 0)
    assert events == [
        {"type": "BlockStored", "block_hashes": [H1, H2], "parent_block_hash": None,
         "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
         "lora_name": None, "extra_keys": [["salt"], None], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [H2], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]  # fmt: skip


def test_array_layout_as_older_vllm_encodes_it() -> None:
    payload = encode_event_batch(2.0, [STORED, BlockRemoved((H2,)), AllBlocksCleared()], "array")
    assert msgpack.unpackb(payload) == [
        2.0,
        [
            ["BlockStored", [H1, H2], None, list(range(8)), 4, None, "GPU", None],
            ["BlockRemoved", [H2], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]


@pytest.fixture
def subscriber() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    """A SUB socket bound to a free port (the pods' publishers connect to it)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.bind("tcp://127.0.0.1:*")
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        yield sock, endpoint
    finally:
        sock.close(linger=0)


def receive(sock: zmq.Socket[bytes], timeout_s: float) -> list[list[bytes]]:
    messages: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000)):
        messages.append(sock.recv_multipart())
        deadline = time.monotonic() + 0.2  # a little more, then stop once quiet
    return messages


def connect(pods: SimPods, sock: zmq.Socket[bytes]) -> int:
    """Send throwaway requests until events arrive (ZMQ drops what precedes the connection)."""
    for i in range(50):
        body = {"prompt": f"warm-up {i} " * 8, "max_tokens": 1}
        httpx.post(pods.pods[0].url + "/v1/completions", json=body)
        if messages := receive(sock, 0.1):
            return int.from_bytes(messages[-1][1], "big")
    raise AssertionError("no KV events arrived")


@pytest.mark.parametrize("layout", ["map", "array"])
def test_a_pod_publishes_its_blocks_as_vllm_does(
    subscriber: tuple[zmq.Socket[bytes], str], layout: Any
) -> None:
    sock, endpoint = subscriber
    settings = GroupSettings(
        num_pods=1,
        model="m",
        engine=FAST_ENGINE,
        kv_events=KvEventsSettings(endpoint, layout=layout),
    )
    with run_sim_pods(settings) as pods:
        last_seq = connect(pods, sock)
        prompt = "the events of one request " * 4  # 104 bytes: 26 tokens, 1 full block
        httpx.post(pods.pods[0].url + "/v1/completions", json={"prompt": prompt, "max_tokens": 9})
        messages = receive(sock, 2.0)
        pods.reset_cache(0)
        messages += receive(sock, 2.0)
    topics = {m[0] for m in messages}
    assert topics == {f"kv@127.0.0.1:{pods.pods[0].port}@m".encode()}
    seqs = [int.from_bytes(m[1], "big") for m in messages]
    assert seqs == list(range(last_seq + 1, last_seq + 1 + len(messages)))
    events = [e for m in messages for e in decode_event_batch(m[2])[1]]
    tokens = tokenize(prompt)
    hashes = hash_request_tokens(tokens, 16)
    if layout == "map":
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert stored[0]["block_hashes"] == hashes
        assert stored[0]["parent_block_hash"] is None
        assert stored[0]["token_ids"] == tokens[:16]
        assert stored[1]["parent_block_hash"] == hashes[0]  # block 1, filled while decoding
        assert events[-1] == {"type": "AllBlocksCleared"}
    else:
        stored = [e for e in events if e[0] == "BlockStored"]
        assert stored[0][1:5] == [hashes, None, tokens[:16], 16]
        assert events[-1] == ["AllBlocksCleared"]
