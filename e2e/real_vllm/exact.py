"""Helpers for the precise-prefix-cache tests against real vLLM: send a request straight to
a pod, compare extproc's predicted cached tokens with the pod's own report, and start a
pod's view exact (connected, then cleared)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import orjson

from e2e.real_vllm.pods import BLOCK_SIZE, MODEL, VllmPod
from extproc.pods import PodId
from extproc.prefix.precise.keys import chain_keys
from extproc.request.parse import Api, parse_request
from extproc.scheduling.interfaces import Cycle
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from testkit.waiting import wait_until

EVENTS_TIMEOUT_S = 30.0
MAX_TOKENS = 4


def post(client: httpx.Client, pod: VllmPod, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post(pod.url + path, json=body)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def warm_prompt() -> dict[str, Any]:
    """A completions request with a prompt never sent before (so it stores blocks)."""
    return {"model": MODEL, "prompt": f"warm up {uuid.uuid4()} " + "hello " * 40, "max_tokens": 1}


def start_exact(plugin: PrecisePrefixCache, pod: VllmPod, client: httpx.Client) -> None:
    """Connected (ZMQ joins late), then reset: the view is exact from the clear on, which
    is known once a prompt sent before the reset is gone from it and one sent after is in."""
    pod_id = pod.as_pod().id

    def seen() -> bool:
        # A new prompt each time: a repeated one is a cache hit and stores no block, so
        # its events, if the first were sent before ZMQ joined, would never come again.
        post(client, pod, "/v1/completions", warm_prompt())
        return pod_id in plugin.index.views

    wait_until(seen, EVENTS_TIMEOUT_S, what=f"no events from {pod.name}")
    before = warm_prompt()
    post(client, pod, "/v1/completions", before)
    wait_until(lambda: _held(plugin, pod_id, before) == 1.0, EVENTS_TIMEOUT_S)
    pod.reset_prefix_cache()
    after = warm_prompt()
    post(client, pod, "/v1/completions", after)  # carries AllBlocksCleared out

    def cleared() -> bool:
        return (
            not plugin.index.view(pod_id).stale()
            and _held(plugin, pod_id, before) == 0.0
            and _held(plugin, pod_id, after) == 1.0
        )

    wait_until(cleared, EVENTS_TIMEOUT_S, what=f"{pod.name}'s clear never came")


def _held(plugin: PrecisePrefixCache, pod_id: PodId, body: dict[str, Any]) -> float:
    """The fraction of a completions request's blocks in the pod's view."""
    tokens = plugin.prompt_tokens(Cycle(parse_request("/v1/completions", orjson.dumps(body))))
    assert tokens is not None
    keys = chain_keys(tokens, BLOCK_SIZE)
    return plugin.index.match(pod_id, keys)[0] / len(keys)


def with_max_tokens(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` generating exactly ``MAX_TOKENS`` tokens."""
    field = "max_output_tokens" if path == Api.RESPONSES.value else "max_tokens"
    return {**body, field: MAX_TOKENS, "ignore_eos": True}


def cached_and_prompt_tokens(path: str, usage: dict[str, Any]) -> tuple[int, int]:
    """The pod's report: (cached prompt tokens, prompt tokens)."""
    prefix = "input" if path == Api.RESPONSES.value else "prompt"
    details = usage.get(f"{prefix}_tokens_details") or {}
    return details.get("cached_tokens") or 0, usage[f"{prefix}_tokens"]


def check(
    plugin: PrecisePrefixCache, client: httpx.Client, pod: VllmPod, path: str, body: dict[str, Any]
) -> tuple[int, int]:
    """One request: extproc's prediction == the pod's report; then wait for its events.

    Returns:
        (predicted cached tokens, prompt tokens)
    """
    body = with_max_tokens(path, body)
    cycle = Cycle(parse_request(path, orjson.dumps(body)))
    the_pod = pod.as_pod()
    tokens = plugin.prompt_tokens(cycle)
    assert tokens is not None, f"{path} not tokenized exactly"
    predicted = plugin.matched_tokens(cycle, [the_pod])[the_pod.id]
    cached, num_prompt = cached_and_prompt_tokens(path, post(client, pod, path, body)["usage"])
    assert num_prompt == len(tokens), (path, body)
    assert predicted == cached, (pod.name, path, body.get("cache_salt"), len(tokens))
    keys = chain_keys(tokens, BLOCK_SIZE, cycle.request.cache_salt)
    wait_until(
        lambda: plugin.index.match(the_pod.id, keys)[0] == len(keys),
        EVENTS_TIMEOUT_S,
        what="the request's blocks never showed up in the pod's events",
    )
    return predicted, len(tokens)
