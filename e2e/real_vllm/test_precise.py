"""precise-prefix-cache against real vLLM: the cached tokens extproc predicts for a request
on a pod equal what that pod then reports (``usage.prompt_tokens_details.cached_tokens``,
``usage.input_tokens_details.cached_tokens`` for responses), request after request, for
chat, completions and responses, with and without ``cache_salt``, and after a
``/reset_prefix_cache``; the prompt's token count equals the usage's. And the token ids
extproc computes for the chat and responses tables of ``tests/request/test_chat_input``
equal the pod's own rendering (its ``/render`` endpoints).

The pods publish their KV events to their own concrete endpoints (so they connect); the
subscriber binds all three (the bind topology), and each topic names its pod. Requests
go straight to one pod each, round robin, so every pod's view is exercised, hits and
misses alike.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from e2e.conftest import wait_for
from e2e.real_vllm.pods import BLOCK_SIZE, MODEL, VllmPod
from e2e.real_vllm.prepare import model_dir
from extproc.datalayer.kv_events import EventsSettings, KvEventsSubscriber
from extproc.prefix.precise.keys import chain_keys
from extproc.request.parse import Api, parse_request
from extproc.request.tokens import SegmentTokenizer
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.scheduling.types import Cycle, PluginContext
from tests.request.test_chat_input import CHAT_CASES, RESPONSES_CASES

pytestmark = [pytest.mark.e2e, pytest.mark.real_vllm, pytest.mark.timeout(900)]

EVENTS_TIMEOUT_S = 30.0


@pytest.fixture
def precise(vllm_pods: list[VllmPod]) -> Iterator[PrecisePrefixCache]:
    plugin = PrecisePrefixCache.from_args(
        {"models": {MODEL: str(model_dir())}, "blockSize": BLOCK_SIZE},
        PluginContext(CollectorRegistry()),
    )
    endpoints = tuple(p.kv_events_endpoint for p in vllm_pods)
    subscriber = KvEventsSubscriber(
        plugin.index, EventsSettings("bind", bind=endpoints), CollectorRegistry()
    )
    plugin.attach(subscriber)
    plugin.pods_changed([p.as_pod() for p in vllm_pods])
    subscriber.start()
    try:
        with httpx.Client(timeout=120) as client:
            for pod in vllm_pods:
                _start_exact(plugin, pod, client)
        yield plugin
    finally:
        subscriber.stop()


def _post(client: httpx.Client, pod: VllmPod, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post(pod.url + path, json=body)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _start_exact(plugin: PrecisePrefixCache, pod: VllmPod, client: httpx.Client) -> None:
    """Connected (ZMQ joins late), then reset: the view is exact from the clear on."""
    pod_id = pod.as_pod().id

    def warm() -> dict[str, Any]:
        # A new prompt each time: a repeated one is a cache hit and stores no block, so
        # its events, if the first were sent before ZMQ joined, would never come again.
        prompt = f"warm up {uuid.uuid4()} " + "hello " * 40
        return {"model": MODEL, "prompt": prompt, "max_tokens": 1}

    def seen() -> bool:
        _post(client, pod, "/v1/completions", warm())
        return pod_id in plugin.index.views

    assert wait_for(seen, EVENTS_TIMEOUT_S), f"no events from {pod.name}"
    pod.reset_prefix_cache()
    _post(client, pod, "/v1/completions", warm())  # carries AllBlocksCleared out
    assert wait_for(lambda: not plugin.index.view(pod_id).stale(), EVENTS_TIMEOUT_S)


def _requests() -> list[tuple[str, dict[str, Any]]]:
    system = f"[{uuid.uuid4()}] " + "You route requests for the platform team. " * 14
    doc = f"<{uuid.uuid4()}> " + "The quick brown fox jumps over the lazy dog. " * 20
    out: list[tuple[str, dict[str, Any]]] = []
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for turn in range(4):
        messages = [*messages, {"role": "user", "content": f"Question {turn}: why?"}]
        body = {"model": MODEL, "messages": messages}
        out.append(("/v1/chat/completions", body))
        out.append(("/v1/chat/completions", {**body, "cache_salt": "tenant-a"}))
        messages = [*messages, {"role": "assistant", "content": f"Because {turn}."}]
    # The same conversation through the responses API: instructions, then input items.
    items: list[dict[str, Any]] = []
    for turn in range(3):
        items = [*items, {"role": "user", "content": f"Question {turn}: why?"}]
        body = {"model": MODEL, "instructions": system, "input": items}
        out.append(("/v1/responses", body))
        out.append(("/v1/responses", {**body, "cache_salt": "tenant-a"}))
        items = [*items, {"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": f"Because {turn}."}]}]  # fmt: skip
    for tail in ("Summarize.", "Translate.", "Summarize."):
        prompt = doc + tail
        out.append(("/v1/completions", {"model": MODEL, "prompt": prompt}))
        out.append(("/v1/completions", {"model": MODEL, "prompt": prompt, "cache_salt": "b"}))
    # Exactly two blocks of token ids: sent again, vLLM computes the whole last block.
    out.append(("/v1/completions", {"model": MODEL, "prompt": [1000 + t for t in range(64)]}))
    return out


def _check(
    plugin: PrecisePrefixCache, client: httpx.Client, pod: VllmPod, path: str, body: dict[str, Any]
) -> tuple[int, int]:
    """One request: extproc's prediction == the pod's report; then wait for its events."""
    responses = path == Api.RESPONSES.value
    body = {**body, "max_output_tokens" if responses else "max_tokens": 4, "ignore_eos": True}
    cycle = Cycle(parse_request(path, orjson.dumps(body)))
    the_pod = pod.as_pod()
    predicted = plugin.matched_tokens(cycle, [the_pod])[the_pod.id]
    tokens = plugin.prompt_tokens(cycle)
    assert tokens is not None
    usage = _post(client, pod, path, body)["usage"]
    prefix = "input" if responses else "prompt"
    cached = (usage.get(f"{prefix}_tokens_details") or {}).get("cached_tokens") or 0
    assert usage[f"{prefix}_tokens"] == len(tokens), (path, body)
    assert predicted == cached, (pod.name, path, body.get("cache_salt"), len(tokens))
    keys = chain_keys(tokens, BLOCK_SIZE, cycle.request.cache_salt)
    assert wait_for(
        lambda: plugin.index.match(the_pod.id, keys)[0] == len(keys), EVENTS_TIMEOUT_S
    ), "the request's blocks never showed up in the pod's events"
    return predicted, len(tokens)


def test_predicted_cached_tokens_equal_vllms_report(
    precise: PrecisePrefixCache, vllm_pods: list[VllmPod]
) -> None:
    hits = 0
    requests = _requests()
    with httpx.Client(timeout=120) as client:
        # The first round spreads the requests (partial hits: shared system prompt and
        # history, misses across salts); the second sends each again to the same pod,
        # whose whole prompt is then cached (the last-token rule).
        for _ in range(2):
            for i, (path, body) in enumerate(requests):
                pod = vllm_pods[i % len(vllm_pods)]
                predicted, _ = _check(precise, client, pod, path, body)
                hits += predicted > 0
        assert hits >= len(requests)  # the second round all hits
        pod = vllm_pods[0]
        pod.reset_prefix_cache()
        path, body = _requests()[0]
        # The clear reaches us with the next request's events: predicted for the old view.
        _post(client, pod, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        pod_id = pod.as_pod().id
        assert wait_for(lambda: precise.index.view(pod_id).num_blocks("GPU") <= 1, 30)
        predicted, _ = _check(precise, client, pod, path, body)
        assert predicted == 0


@pytest.fixture(scope="module")
def tok() -> SegmentTokenizer:
    return SegmentTokenizer(model_dir())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param(Api.RESPONSES.value, c.values[0], id=f"responses-{c.id}")
        for c in RESPONSES_CASES
    ]
    + [
        pytest.param(Api.CHAT_COMPLETIONS.value, c.values[0], id=f"chat-{c.id}") for c in CHAT_CASES
    ],
)
def test_token_ids_equal_the_pods_own_rendering(
    vllm_pods: list[VllmPod], tok: SegmentTokenizer, path: str, body: dict[str, Any]
) -> None:
    with httpx.Client(timeout=60) as client:
        rendered = _post(client, vllm_pods[0], path + "/render", {"model": MODEL, **body})
    assert tok.request_tokens(Api(path), body) == rendered["token_ids"]
