"""The OpenAI API of a simulated pod: shapes plain and streamed, usage, errors, models."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from extproc.sim.launch import SimPods
from extproc.sim.tokenizer import ChatMessage, render_chat, tokenize


def client(pods: SimPods, pod: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=pods.pods[pod].url + "/v1", api_key="unused", max_retries=0)


def sse_lines(url: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", url, json=body, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        return [line for line in resp.iter_lines() if line]


def test_chat_plain_with_the_openai_client(pods: SimPods) -> None:
    content = "Tell me about prefix caching, please."
    raw = client(pods).chat.completions.with_raw_response.create(
        model="sim-llm", messages=[{"role": "user", "content": content}], max_tokens=5
    )
    assert raw.headers["x-sim-pod"] == "sim-0"
    chat = raw.parse()
    assert chat.object == "chat.completion"
    assert chat.id.startswith("chatcmpl-")
    assert chat.model == "sim-llm"
    assert chat.system_fingerprint == "sim-0"
    (choice,) = chat.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert choice.message.content is not None
    assert len(tokenize(choice.message.content)) == 5
    expected_prompt = len(render_chat([ChatMessage("user", content)]))
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == expected_prompt
    assert chat.usage.completion_tokens == 5
    assert chat.usage.total_tokens == expected_prompt + 5
    assert chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens is not None


def test_chat_stream_with_the_openai_client_matches_the_plain_answer(pods: SimPods) -> None:
    messages: Any = [{"role": "user", "content": "stream this " * 30}]
    c = client(pods, 1)
    plain = c.chat.completions.create(model="sim-llm", messages=messages, max_completion_tokens=7)
    chunks = list(
        c.chat.completions.create(
            model="sim-llm",
            messages=messages,
            max_completion_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert all(ch.system_fingerprint == "sim-1" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish == [None] * 7 + ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 7
    assert usage_chunk.usage.prompt_tokens_details is not None
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == 96  # the plain call's


def test_completions_plain_and_stream_with_the_openai_client(pods: SimPods) -> None:
    c = client(pods)
    prompt = "Once upon a time " * 8
    plain = c.completions.create(model="sim-llm", prompt=prompt, max_tokens=4)
    assert plain.object == "text_completion"
    assert plain.id.startswith("cmpl-")
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage is not None and plain.usage.prompt_tokens == len(tokenize(prompt))
    chunks = list(c.completions.create(model="sim-llm", prompt=prompt, max_tokens=4, stream=True))
    assert len(chunks) == 4
    assert "".join(ch.choices[0].text for ch in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.usage is None for ch in chunks)  # no include_usage, no usage chunk


def test_completions_accept_token_ids(pods: SimPods) -> None:
    tokens = tokenize("same text as tokens")
    by_text = client(pods).completions.create(model="sim-llm", prompt="same text as tokens")
    by_ids = client(pods).completions.create(model="sim-llm", prompt=tokens)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.completion_tokens == 16  # the default


def test_responses_plain_and_stream_with_the_openai_client(pods: SimPods) -> None:
    c = client(pods)
    plain = c.responses.create(
        model="sim-llm", input="hello there", instructions="be brief", max_output_tokens=3
    )
    assert plain.object == "response"
    assert plain.id.startswith("resp_")
    assert plain.status == "incomplete"  # stopped by max_output_tokens, as in vLLM
    assert len(tokenize(plain.output_text)) == 3
    assert plain.usage is not None
    assert plain.usage.output_tokens == 3
    prompt = render_chat([ChatMessage("system", "be brief"), ChatMessage("user", "hello there")])
    assert plain.usage.input_tokens == len(prompt)
    events = list(
        c.responses.create(
            model="sim-llm",
            input=[{"role": "user", "content": "hello there"}],
            instructions="be brief",
            max_output_tokens=3,
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert types[0] == "response.created"
    assert types[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == plain.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.usage is not None
    assert done.response.usage.input_tokens_details.cached_tokens == 16


def test_streams_end_as_vllm_ends_them(pods: SimPods) -> None:
    base = pods.pods[0].url
    body = {"model": "sim-llm", "max_tokens": 2, "stream": True}
    completion = sse_lines(base + "/v1/completions", {**body, "prompt": "abc"})
    assert completion[-1] == "data: [DONE]"
    chat = sse_lines(
        base + "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "x"}]}
    )
    assert chat[-1] == "data: [DONE]"
    responses = sse_lines(base + "/v1/responses", {**body, "input": "x"})
    assert responses[-2:][0] == "event: response.completed"  # event/data pairs, no [DONE]
    assert all(line.startswith(("event: ", "data: {")) for line in responses)


def test_cached_tokens_rise_on_a_repeat_and_on_the_next_turn(pods: SimPods) -> None:
    c = client(pods, 1)
    history: list[Any] = [
        {"role": "system", "content": "You are a helpful assistant. " * 10},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    first = c.chat.completions.create(model="sim-llm", messages=history, max_tokens=20)
    again = c.chat.completions.create(model="sim-llm", messages=history, max_tokens=20)
    assert first.usage is not None and again.usage is not None
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    answer = first.choices[0].message.content
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    turn2 = c.chat.completions.create(model="sim-llm", messages=history, max_tokens=5)
    assert turn2.usage is not None and turn2.usage.prompt_tokens_details is not None
    # prompt + answer minus its last token were computed, so cached in full blocks
    assert turn2.usage.prompt_tokens_details.cached_tokens == (n + 20 - 1) // 16 * 16


def test_cache_salt_isolates_and_is_shared_within_a_salt(pods: SimPods) -> None:
    url = pods.pods[0].url + "/v1/completions"
    prompt = "tenant data " * 20

    def cached(**extra: Any) -> int:
        body = {"prompt": prompt, "max_tokens": 1, **extra}
        return int(
            httpx.post(url, json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        )

    cached()
    assert cached() > 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-b") > 0


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        pytest.param("/v1/completions", {"prompt": "x", "model": "other"}, 404,
                     "The model `other` does not exist.", id="wrong-model"),
        pytest.param("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400,
                     "max_tokens must be an integer of at least 1", id="max-tokens-0"),
        pytest.param("/v1/completions", {"max_tokens": 3}, 400, "prompt must be", id="no-prompt"),
        pytest.param("/v1/completions", {"prompt": ""}, 400, "The prompt is empty.", id="empty"),
        pytest.param("/v1/completions", {"prompt": "x", "stream_options": {}}, 400,
                     "Stream options can only be defined when `stream=True`.", id="options"),
        pytest.param("/v1/completions", {"prompt": "x", "cache_salt": ""}, 400,
                     "cache_salt", id="empty-salt"),
        pytest.param("/v1/completions", {"prompt": "x" * 200_000}, 400,
                     "maximum context length is 32768 tokens. However, your prompt contains "
                     "50000 input tokens", id="too-long"),
        pytest.param("/v1/completions", {"prompt": "xxxx" * 32768}, 400,
                     "(length 32768) plus the number of requested output tokens", id="full"),
        pytest.param("/v1/chat/completions", {"messages": []}, 400,
                     "messages must be a non-empty list", id="no-messages"),
        pytest.param("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400,
                     "string role", id="no-role"),
        pytest.param("/v1/responses", {"input": 3}, 400, "input must be", id="bad-input"),
        pytest.param("/v1/responses", {"input": "x", "max_output_tokens": "3"}, 400,
                     "max_output_tokens", id="bad-max-output"),
    ],
)  # fmt: skip
def test_bad_requests_get_vllm_error_bodies(
    pods: SimPods, path: str, body: dict[str, Any], status: int, message: str
) -> None:
    resp = httpx.post(pods.pods[0].url + path, json=body)
    assert resp.status_code == status
    assert resp.headers["x-sim-pod"] == "sim-0"
    error = resp.json()["error"]
    assert message in error["message"]
    assert error["code"] == status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert set(error) == {"message", "type", "param", "code"}


def test_max_tokens_is_lowered_to_the_room_left_in_the_context(pods: SimPods) -> None:
    """As vLLM: a prompt that fits but leaves less room than ``max_tokens`` is not refused."""
    body = {"model": "sim-llm", "prompt": "xxxx" * 32760, "max_tokens": 100}
    resp = httpx.post(pods.pods[0].url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 8


def test_body_that_is_not_json_is_a_bad_request(pods: SimPods) -> None:
    resp = httpx.post(pods.pods[0].url + "/v1/completions", content=b"{nope")
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "BadRequestError"


def test_openai_client_raises_its_own_errors(pods: SimPods) -> None:
    with pytest.raises(openai.NotFoundError):
        client(pods).completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client(pods).completions.create(model="sim-llm", prompt="x", max_tokens=0)


def test_models_and_health(pods: SimPods) -> None:
    models = client(pods).models.list()
    assert [m.id for m in models.data] == ["sim-llm"]
    health = httpx.get(pods.pods[1].url + "/health")
    assert health.status_code == 200
    assert health.headers["x-sim-pod"] == "sim-1"


def test_render_endpoints_give_the_prompts_token_ids(pods: SimPods) -> None:
    url = pods.pods[0].url
    plain = httpx.post(
        url + "/v1/completions/render", json={"model": "sim-llm", "prompt": "hello there"}
    ).json()
    assert plain[0]["token_ids"] == tokenize("hello there")
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(
        url + "/v1/chat/completions/render", json={"model": "sim-llm", "messages": messages}
    ).json()
    assert chat["token_ids"] == render_chat([ChatMessage("user", "hi")])
    bad = httpx.post(url + "/v1/completions/render", json={"model": "other", "prompt": "x"})
    assert bad.status_code == 404
