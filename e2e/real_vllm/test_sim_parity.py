"""The simulated pods against real vLLM: metric names and types, API shapes, KV events,
forced tool calls.

Both sides get the same requests; what is compared is structure, never values (the sim's
tokenizer and timing are its own), except for a forced tool call whose one possible
answer both must give. A shape is the set of dotted key paths of a JSON value, list items
merged under ``[]``.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgpack
import orjson
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from e2e.real_vllm.pods import MODEL, VllmPod, start_vllm_pods
from e2e.real_vllm.prepare import prepare
from extproc.datalayer.engine_metrics import SAMPLE_NAMES, PageParser, read_samples
from extproc.datalayer.scrape import FILTERED_PAGE
from extproc.sim.launch import SimPods, free_port
from extproc.sim.pods import GroupSettings, KvEventsSettings
from testkit.harness import run_sim_pods

pytestmark = [pytest.mark.e2e, pytest.mark.real_vllm, pytest.mark.timeout(900)]

QUESTION = "Name three colours of the rainbow, please."
BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": QUESTION, "max_tokens": 3},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 3},
    "/v1/responses": {"input": QUESTION, "max_output_tokens": 3},
}
STREAMED = {"stream": True}
USAGE = {"stream_options": {"include_usage": True}}


def shape(value: Any, path: str = "") -> set[str]:
    if isinstance(value, dict):
        out = {path} if path else set()
        for k, v in value.items():
            if v is not None:  # a null is the same as an absent field to a client
                out |= shape(v, f"{path}.{k}" if path else k)
        return out
    if isinstance(value, list):
        out = {path + "[]"}
        for item in value:
            out |= shape(item, path + "[]")
        return out
    return {path}


def stream_shapes(resp: httpx.Response) -> dict[str, set[str]]:
    """Per SSE event name (``data`` when unnamed): the union of its payloads' shapes."""
    return stream_shapes_of(resp.iter_lines())


def stream_shapes_of(lines: Iterable[str]) -> dict[str, set[str]]:
    shapes: dict[str, set[str]] = {}
    event = "data"
    for line in lines:
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            key = "[DONE]" if data == "[DONE]" else event
            shapes.setdefault(key, set()).update(
                set() if data == "[DONE]" else shape(orjson.loads(data))
            )
            event = "data"
    return shapes


@pytest.fixture(scope="module")
def sim_pod() -> Iterator[tuple[SimPods, str]]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = GroupSettings(num_pods=1, model=MODEL, kv_events=KvEventsSettings(endpoint))
    with run_sim_pods(settings) as pods:
        yield pods, endpoint


def both(vllm_pods: list[VllmPod], sim_pod: tuple[SimPods, str]) -> dict[str, str]:
    return {"vllm": vllm_pods[0].url, "sim": sim_pod[0].urls[0]}


def test_sim_metrics_have_vllms_names_and_types(
    vllm_pods: list[VllmPod], sim_pod: tuple[SimPods, str]
) -> None:
    pages = {
        name: httpx.get(url + "/metrics").text for name, url in both(vllm_pods, sim_pod).items()
    }
    real = {f.name: f.type for f in text_string_to_metric_families(pages["vllm"])}
    sim = {f.name: f.type for f in text_string_to_metric_families(pages["sim"])}
    assert {n: real.get(n) for n in sim} == sim


def test_filtered_metrics_page_is_served_alike(
    vllm_pods: list[VllmPod], sim_pod: tuple[SimPods, str]
) -> None:
    """extproc's scraper asks for ``/metrics/?name[]=...``: on vLLM (and the sim) that
    page holds just those samples and reads the same as the full page; ``/metrics``
    ignores the filter, which is why the scraper does not ask there."""
    for name, url in both(vllm_pods, sim_pod).items():
        filtered = httpx.get(url + FILTERED_PAGE).text
        full = httpx.get(url + "/metrics").text
        ignored = httpx.get(url + FILTERED_PAGE.replace("/metrics/", "/metrics", 1)).text
        names = {s.name for f in text_string_to_metric_families(filtered) for s in f.samples}
        assert names <= SAMPLE_NAMES, name
        assert {"vllm:num_requests_waiting", "vllm:cache_config_info"} <= names, name
        assert len(filtered) * 5 < len(full) and "_bucket" in ignored, name
        models = frozenset({MODEL})
        readings = [
            read_samples(PageParser().samples(p.encode()), models) for p in (filtered, full)
        ]
        assert readings[0] is not None and readings[0] == readings[1], name


@pytest.mark.parametrize("api", list(BODIES))
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_sim_api_shapes_match_vllm(
    vllm_pods: list[VllmPod], sim_pod: tuple[SimPods, str], api: str, stream: bool
) -> None:
    body = {"model": MODEL, **BODIES[api], **(STREAMED if stream else {})}
    if stream and api != "/v1/responses":
        body.update(USAGE)
    shapes = {}
    for name, url in both(vllm_pods, sim_pod).items():
        with httpx.stream("POST", url + api, json=body, timeout=60) as resp:
            assert resp.status_code == 200, resp.read()
            if stream:
                shapes[name] = stream_shapes(resp)
            else:
                shapes[name] = {"body": shape(orjson.loads(resp.read()))}
    assert shapes["sim"] == shapes["vllm"]


def first_block_stored(sub: zmq.Socket[bytes], send: Callable[[], object]) -> list[bytes]:
    """Run ``send`` and return the first message on ``sub`` holding a BlockStored.

    libzmq attaches a new connection (and forwards our subscription) only while this
    thread is inside a zmq call, hence polling rather than sleeping before and after.
    """
    sub.poll(1000)  # the publisher, retrying every 100 ms, connects meanwhile
    send()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not sub.poll(500):
            continue
        frames = sub.recv_multipart()
        events = msgpack.unpackb(frames[2])[1]
        if any(_tag(e) == "BlockStored" for e in events):
            return frames
    raise AssertionError("no BlockStored message")


def _tag(event: Any) -> Any:
    return event.get("type") if isinstance(event, dict) else event[0]


def layout(frames: list[bytes]) -> dict[str, Any]:
    """What a subscriber relies on: frames, topic form, sequence width, payload and event types."""
    ts, events, rank = msgpack.unpackb(frames[2])
    stored = next(e for e in events if _tag(e) == "BlockStored")
    fields = stored.items() if isinstance(stored, dict) else enumerate(stored)
    return {
        "frames": len(frames),
        "topic": frames[0].decode().split("@")[0],
        "seq_bytes": len(frames[1]),
        "payload": [type(ts).__name__, type(events).__name__, type(rank).__name__],
        "event": {k: _type_of(v) for k, v in fields},
    }


def _type_of(value: Any) -> str:
    if isinstance(value, list):
        return "list[" + ",".join(sorted({_type_of(v) for v in value})) + "]"
    return type(value).__name__


def test_sim_kv_events_have_vllms_layout(
    vllm_pods: list[VllmPod], sim_pod: tuple[SimPods, str]
) -> None:
    prompt = f"[{uuid.uuid4()}] A prompt long enough to fill a few blocks of tokens. " * 8
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    layouts = {}
    for name, endpoint, url in (
        ("vllm", vllm_pods[0].kv_events_endpoint, vllm_pods[0].url),
        ("sim", sim_pod[1], sim_pod[0].urls[0]),
    ):
        sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.bind(endpoint)
            send = partial(httpx.post, url + "/v1/completions", json=body, timeout=60)
            layouts[name] = layout(first_block_stored(sub, send))
        finally:
            sub.close(linger=0)
    assert layouts["sim"] == layouts["vllm"]


@pytest.mark.parametrize("api", ["/v1/completions", "/v1/chat/completions"])
def test_sim_render_endpoints_answer_like_vllms(
    vllm_pods: list[VllmPod], sim_pod: tuple[SimPods, str], api: str
) -> None:
    """vllm-router's cache_aware policy reads ``token_ids`` from these; the sim's fields
    are a subset of vLLM's (whose sampling parameters are far more numerous)."""
    body = {"model": MODEL, **BODIES[api]}
    answers = {
        name: httpx.post(url + api + "/render", json=body, timeout=60).json()
        for name, url in both(vllm_pods, sim_pod).items()
    }
    for answer in answers.values():
        item = answer[0] if api == "/v1/completions" else answer
        assert item["token_ids"] and all(isinstance(t, int) for t in item["token_ids"])
    assert shape(answers["sim"]) <= shape(answers["vllm"])


# Forced tool calls: the sim answers as vLLM with Hermes' tool parser does, which the
# shared pods are not started with (vLLM refuses tools without a parser).
TOOL_PARSER_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
# One possible call: the random-weight model, held to the schema by vLLM's structured
# output (strict tool calling), can only end it, and the sim's schema value is the same.
PICK = {"name": "pick_unit", "strict": True, "parameters": {"enum": ["celsius"]}}
TOOL_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [{"type": "function", "function": PICK}],
        "tool_choice": {"type": "function", "function": {"name": "pick_unit"}},
        "max_tokens": 200,
    },
    "/v1/responses": {
        "input": QUESTION,
        "tools": [{"type": "function", **PICK}],
        "tool_choice": {"type": "function", "name": "pick_unit"},
        "max_output_tokens": 200,
    },
}


@pytest.fixture(scope="module")
def vllm_tool_pod() -> Iterator[VllmPod]:
    prepare()
    with (
        tempfile.TemporaryDirectory(prefix="extproc-vllm-tools-") as tmp,
        start_vllm_pods(1, Path(tmp), extra_args=TOOL_PARSER_FLAGS) as pods,
    ):
        yield pods[0]


def tool_call_of(api: str, answer: Any) -> tuple[str, str, str]:
    """A whole answer's (name, arguments, finish): chat's finish reason, or the
    response's status."""
    if api == "/v1/responses":
        (item,) = answer["output"]
        return item["name"], item["arguments"], answer["status"]
    (choice,) = answer["choices"]
    (call,) = choice["message"]["tool_calls"]
    return call["function"]["name"], call["function"]["arguments"], choice["finish_reason"]


def streamed_tool_call_of(api: str, events: list[Any]) -> tuple[str, str, str]:
    """The same, added up from a stream's events."""
    if api == "/v1/responses":
        done = next(e for e in events if e["type"] == "response.output_item.done")["item"]
        arguments = "".join(e["delta"] for e in events if e["type"].endswith("arguments.delta"))
        return done["name"], arguments, events[-1]["response"]["status"]
    name, arguments, finish = "", "", ""
    for choice in (c["choices"][0] for c in events if c["choices"]):
        for delta in choice["delta"].get("tool_calls") or []:
            name += delta["function"].get("name", "")
            arguments += delta["function"].get("arguments", "")
        finish = choice["finish_reason"] or finish
    return name, arguments, finish


@pytest.mark.parametrize("api", list(TOOL_BODIES))
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_sim_forced_tool_call_matches_vllm(
    vllm_tool_pod: VllmPod, sim_pod: tuple[SimPods, str], api: str, stream: bool
) -> None:
    body = {"model": MODEL, **TOOL_BODIES[api], **(STREAMED if stream else {})}
    if stream and api != "/v1/responses":
        body.update(USAGE)
    shapes, calls = {}, {}
    for name, url in {"vllm": vllm_tool_pod.url, "sim": sim_pod[0].urls[0]}.items():
        with httpx.stream("POST", url + api, json=body, timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            if not stream:
                answer = orjson.loads(resp.read())
                shapes[name], calls[name] = {"body": shape(answer)}, tool_call_of(api, answer)
                continue
            lines = list(resp.iter_lines())
        shapes[name] = stream_shapes_of(lines)
        events = [orjson.loads(x[6:]) for x in lines if x.startswith("data: {")]
        calls[name] = streamed_tool_call_of(api, events)
    finish = "completed" if api == "/v1/responses" else "stop"
    assert calls["vllm"] == calls["sim"] == ("pick_unit", '"celsius"', finish)
    assert shapes["sim"] == shapes["vllm"]


def test_sim_refuses_an_unknown_tool_choice_as_vllm_does(
    vllm_tool_pod: VllmPod, sim_pod: tuple[SimPods, str]
) -> None:
    body = {**TOOL_BODIES["/v1/chat/completions"], "model": MODEL,
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}  # fmt: skip
    errors = {
        name: httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        for name, url in {"vllm": vllm_tool_pod.url, "sim": sim_pod[0].urls[0]}.items()
    }
    assert {r.status_code for r in errors.values()} == {400}
    assert errors["sim"].json() == errors["vllm"].json()
