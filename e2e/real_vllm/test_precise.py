"""precise-prefix-cache against real vLLM: the cached tokens extproc predicts for a request
on a pod equal what that pod then reports (``usage.prompt_tokens_details.cached_tokens``,
``usage.input_tokens_details.cached_tokens`` for responses), request after request, for
chat, completions and responses, with and without ``cache_salt``, and after a
``/reset_prefix_cache``; the prompt's token count equals the usage's. And the token ids
extproc computes for the chat and responses tables of ``tests/request/test_chat_input``
equal the pod's own rendering (its ``/render`` endpoints).

Through Envoy and ``extproc serve`` with the precise configuration, the same requests
make extproc's per-pod counters ``extproc_predicted_cached_tokens_total`` and
``extproc_routed_prompt_tokens_total`` equal the pods' own ``vllm:prefix_cache_hits``
and ``vllm:prefix_cache_queries``, and the sums of the usages' cached and prompt tokens.

The pods publish their KV events to their own concrete endpoints (so they connect); the
subscriber binds all three (the bind topology), and each topic names its pod. Requests
go straight to one pod each, round robin, so every pod's view is exercised, hits and
misses alike.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from e2e.real_vllm.exact import (
    EVENTS_TIMEOUT_S,
    cached_and_prompt_tokens,
    check,
    post,
    start_exact,
    warm_prompt,
    with_max_tokens,
)
from e2e.real_vllm.pods import BLOCK_SIZE, MODEL, VllmPod, metric_sum
from e2e.support import metric
from extproc.datalayer.kv_events import EventsSettings, KvEventsSubscriber
from extproc.request.parse import Api
from extproc.request.tokens import SegmentTokenizer
from extproc.scheduling.config import named_config_text
from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.sim.launch import Stack, run_stack
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


PRECISE = "precise-prefix-cache"
QUIET_S = 0.5  # no event applied for this long: a request's batches have all come


@pytest.fixture
def precise_stack(vllm_pods: list[VllmPod], tmp_path: Path) -> Iterator[Stack]:
    """Envoy and ``extproc serve`` with the shipped precise configuration (the pods'
    block size, a short stale time), binding the pods' KV-event endpoints."""
    config = yaml.safe_load(named_config_text("precise"))
    [plugin] = [p for p in config["scheduler"]["pluginConfig"] if p["name"] == PRECISE]
    plugin["args"].update(models={MODEL: str(model_dir())}, blockSize=BLOCK_SIZE, staleSeconds=1)
    path = tmp_path / "precise.yaml"
    path.write_text(yaml.safe_dump(config))
    binds = [a for p in vllm_pods for a in ("--kv-events-bind", p.kv_events_endpoint)]
    args = ["--kv-events-topology", "bind", *binds]
    with run_stack([p.as_pod() for p in vllm_pods], config=path, extproc_args=args) as stack:
        yield stack


def labels(pods: list[VllmPod]) -> list[str]:
    return [str(p.as_pod().id) for p in pods]


def applied_events(stack: Stack, pods: list[VllmPod]) -> float:
    return sum(
        metric(stack, "extproc_kv_events_applied_total", f'pod="{pod}"', absent=0)
        for pod in labels(pods)
    )


def wait_quiet(stack: Stack, pods: list[VllmPod]) -> None:
    """Until no KV event was applied for ``QUIET_S``: the pods' views are up to date."""
    last = (applied_events(stack, pods), time.monotonic())

    def quiet() -> bool:
        nonlocal last
        now = applied_events(stack, pods)
        if now != last[0]:
            last = (now, time.monotonic())
        return time.monotonic() - last[1] >= QUIET_S

    wait_until(quiet, EVENTS_TIMEOUT_S, interval_s=0.1, what="KV events never went quiet")


def start_views(stack: Stack, pods: list[VllmPod], client: httpx.Client) -> None:
    """extproc joined every publisher (its views stale for a second, as joining a running
    one); then each pod's cache is reset, so the views are exact from the clear on."""
    for pod in pods:
        label = f'pod="{pod.as_pod().id}"'

        def joined(pod: VllmPod = pod, label: str = label) -> bool:
            post(client, pod, "/v1/completions", warm_prompt())  # new blocks: an event
            return metric(stack, "extproc_kv_events_batches_received_total", label, absent=0) > 0

        wait_until(joined, EVENTS_TIMEOUT_S, what=f"extproc never heard from {pod.name}")
    for pod in pods:
        pod.reset_prefix_cache()
        post(client, pod, "/v1/completions", warm_prompt())  # carries AllBlocksCleared out
    wait_until(
        lambda: metric(stack, "extproc_kv_events_stale_pods") == 0,
        EVENTS_TIMEOUT_S,
        what="the views stayed stale",
    )
    wait_quiet(stack, pods)


def engine_counts(pods: list[VllmPod]) -> dict[str, tuple[float, float]]:
    """Per pod label: (vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total)."""
    counts = {}
    for pod in pods:
        text = pod.metrics_text()
        counts[str(pod.as_pod().id)] = (
            metric_sum(text, "vllm:prefix_cache_hits_total"),
            metric_sum(text, "vllm:prefix_cache_queries_total"),
        )
    return counts


def extproc_counts(stack: Stack, pods: list[VllmPod]) -> dict[str, tuple[float, float]]:
    """Per pod label: (predicted cached tokens, routed prompt tokens)."""
    return {
        pod: (
            count(stack, "extproc_predicted_cached_tokens_total", pod),
            count(stack, "extproc_routed_prompt_tokens_total", pod),
        )
        for pod in labels(pods)
    }


def count(stack: Stack, name: str, pod: str) -> float:
    return metric(stack, name, f'model="{MODEL}",pod="{pod}"', absent=0)


def ends(stack: Stack, pods: list[VllmPod]) -> float:
    """Requests whose end extproc heard (and counted) on the pods."""
    return sum(count(stack, "extproc_request_duration_seconds_count", p) for p in labels(pods))


def has_ended(stack: Stack, pods: list[VllmPod], num: float) -> bool:
    return ends(stack, pods) == num


def test_the_prediction_counters_equal_the_pods_own(
    precise_stack: Stack, vllm_pods: list[VllmPod]
) -> None:
    stack, pods = precise_stack, vllm_pods
    cached = prompt = 0  # the usages' sums
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        start_views(stack, pods, client)
        engine_before, extproc_before = engine_counts(pods), extproc_counts(stack, pods)
        ended = ends(stack, pods)
        requests = _requests()
        for path, body in [*requests, *requests]:  # the second round: whole prompts cached
            resp = client.post(path, json=with_max_tokens(path, body))
            assert resp.status_code == 200, resp.text
            usage = cached_and_prompt_tokens(path, resp.json()["usage"])
            cached, prompt, ended = cached + usage[0], prompt + usage[1], ended + 1
            wait_until(partial(has_ended, stack, pods, ended), EVENTS_TIMEOUT_S)
            wait_quiet(stack, pods)  # its blocks are in the view before the next is routed
    engine_after, extproc_after = engine_counts(pods), extproc_counts(stack, pods)
    grown = {
        pod: (
            extproc_after[pod][0] - extproc_before[pod][0],
            extproc_after[pod][1] - extproc_before[pod][1],
            engine_after[pod][0] - engine_before[pod][0],
            engine_after[pod][1] - engine_before[pod][1],
        )
        for pod in labels(pods)
    }
    assert cached > 0
    assert sum(g[0] for g in grown.values()) == cached, grown
    assert sum(g[1] for g in grown.values()) == prompt, grown
    for pod, (predicted, routed, hits, queries) in grown.items():
        assert (predicted, routed) == (hits, queries), (pod, grown)


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
