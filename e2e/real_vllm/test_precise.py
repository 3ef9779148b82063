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
import pytest
from prometheus_client import CollectorRegistry

from e2e.real_vllm.exact import check, post, start_exact
from e2e.real_vllm.pods import BLOCK_SIZE, MODEL, VllmPod
from extproc.datalayer.kv_events import EventsSettings, KvEventsSubscriber
from extproc.request.parse import Api
from extproc.request.tokens import SegmentTokenizer
from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from testkit.chat_cases import CHAT_CASES, RESPONSES_CASES
from testkit.e2e_cache import model_dir
from testkit.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.real_vllm, pytest.mark.timeout(900)]


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
    subscriber.set_pods([p.as_pod() for p in vllm_pods])
    plugin.pods_changed([p.as_pod() for p in vllm_pods])
    subscriber.start()
    try:
        with httpx.Client(timeout=120) as client:
            for pod in vllm_pods:
                start_exact(plugin, pod, client)
        yield plugin
    finally:
        subscriber.stop()


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
                predicted, _ = check(precise, client, pod, path, body)
                hits += predicted > 0
        assert hits >= len(requests)  # the second round all hits
        pod = vllm_pods[0]
        pod.reset_prefix_cache()
        path, body = _requests()[0]
        # The clear reaches us with the next request's events: predicted for the old view.
        post(client, pod, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        pod_id = pod.as_pod().id
        wait_until(lambda: precise.index.view(pod_id).num_blocks("GPU") <= 1, 30)
        predicted, _ = check(precise, client, pod, path, body)
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
        rendered = post(client, vllm_pods[0], path + "/render", {"model": MODEL, **body})
    assert tok.request_tokens(Api(path), body) == rendered["token_ids"]
