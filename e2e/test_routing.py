"""Through real Envoy: prefix affinity for all three APIs, salts, errors, steering, clients."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from e2e.support import MODEL, body_for, metric, send_and_wait_recorded, served_by, unique_prefix
from extproc.sim.launch import SimPods, Stack


@pytest.mark.parametrize("api", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_same_prefix_goes_to_the_first_requests_pod(
    stack: Stack, client: httpx.Client, sim: SimPods, api: str
) -> None:
    prefix = unique_prefix()
    first = send_and_wait_recorded(stack, client, api, body_for(api, prefix, "question one?"))
    for i in range(5):
        assert (
            served_by(client.post(api, json=body_for(api, prefix, f"question {i + 2}?"))) == first
        )
    hits = sim.stats(first)["engine"]["prefix_cache_hits"]
    assert hits > 0  # and the engine really reused the cache


def test_different_cache_salt_does_not_share_the_prefix(stack: Stack, client: httpx.Client) -> None:
    prefix = unique_prefix()
    api = "/v1/completions"
    send_and_wait_recorded(stack, client, api, body_for(api, prefix, "q", cache_salt="tenant-a"))
    misses = metric(
        stack, "kthena_router_prefix_cache_match_ratio_bucket", 'le="0.0",model="sim-llm"'
    )
    served_by(client.post(api, json=body_for(api, prefix, "q", cache_salt="tenant-b")))
    after = metric(
        stack, "kthena_router_prefix_cache_match_ratio_bucket", 'le="0.0",model="sim-llm"'
    )
    assert after == misses + 1  # the other tenant's request matched nothing
    send_and_wait_recorded(stack, client, api, body_for(api, prefix, "q2", cache_salt="tenant-a"))
    assert (
        metric(stack, "kthena_router_prefix_cache_match_ratio_bucket", 'le="0.0",model="sim-llm"')
        == after
    )


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        pytest.param(b"{not json", 400, "invalid_json", id="bad-json"),
        # (a body naming no model is routed as the pods' one model: e2e/test_bad_input.py)
        pytest.param(b'{"model": 7, "prompt": "hi"}', 400, "invalid_type", id="model-number"),
        pytest.param(
            b'{"model": "no-such-model", "prompt": "hi"}',
            404,
            "model_not_found",
            id="unknown-model",
        ),
        pytest.param(b'{"model": "sim-llm", "prompt": 12}', 400, "invalid_type", id="wrong-type"),
    ],
)
def test_bad_requests_get_json_errors_and_extproc_keeps_serving(
    client: httpx.Client, content: bytes, status: int, code: str
) -> None:
    resp = client.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert resp.status_code == status
    assert resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["code"] == code
    assert served_by(
        client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "still up?", "max_tokens": 2}
        )
    )


def test_openai_client_plain_and_streamed_chat(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Say something short."}
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert reply.choices[0].message.content and reply.usage and reply.usage.completion_tokens == 5
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason == "length"
    client.close()
