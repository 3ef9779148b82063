"""Request body -> rendered prompt, and every bad-input error."""

from __future__ import annotations

from collections.abc import Mapping

import orjson
import pytest

from extproc.errors import BadRequest, BodyTooLarge
from extproc.request.parse import Api, InferenceRequest, api_for_path, parse_request


def parse(
    api: Api,
    body: object,
    headers: Mapping[str, str] | None = None,
    *,
    session_header: str | None = None,
) -> InferenceRequest:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_request(api.value, raw, headers, session_header=session_header)


def test_completions_prompt_as_is() -> None:
    req = parse(Api.COMPLETIONS, {"model": "m", "prompt": "Hello <|im_start|> world"})
    assert req.prompt == "Hello <|im_start|> world"
    assert req.model == "m" and req.api is Api.COMPLETIONS and not req.stream


def test_completions_list_of_strings_joined_and_token_ids_unscored() -> None:
    assert parse(Api.COMPLETIONS, {"model": "m", "prompt": ["a", "b"]}).prompt == "a\nb"
    assert parse(Api.COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]}).prompt == ""
    assert parse(Api.COMPLETIONS, {"model": "m", "prompt": [[1, 2], [3]]}).prompt == ""


def test_chat_chatml_in_order_with_top_level_system_first() -> None:
    req = parse(
        Api.CHAT_COMPLETIONS,
        {
            "model": "m",
            "system": "Be brief.",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is Kthena?"},
            ],
        },
    )
    assert req.prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is Kthena?<|im_end|>\n"
    )


def test_chat_list_content_keeps_text_parts_joined_by_newline() -> None:
    content = [
        {"type": "text", "text": "one"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        {"type": "input_text", "text": "two"},
        {"type": "output_text", "text": "three"},
        {"type": "input_audio", "input_audio": {"data": "..."}},
    ]
    req = parse(
        Api.CHAT_COMPLETIONS, {"model": "m", "messages": [{"role": "user", "content": content}]}
    )
    assert req.prompt == "<|im_start|>user\none\ntwo\nthree<|im_end|>\n"


def test_responses_instructions_then_input_string() -> None:
    req = parse(Api.RESPONSES, {"model": "m", "instructions": "Be kind.", "input": "Hi"})
    assert (
        req.prompt == "<|im_start|>developer\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_responses_list_keeps_messages_and_skips_other_items() -> None:
    items = [
        {"type": "message", "role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "input_text", "text": "Q"}]},
        {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"},
        {"type": "function_call_output", "call_id": "c", "output": "42"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
    ]
    req = parse(Api.RESPONSES, {"model": "m", "input": items})
    assert req.prompt == (
        "<|im_start|>system\nS<|im_end|>\n"
        "<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\nA<|im_end|>\n"
    )


def test_extracts_salt_stream_and_session_key() -> None:
    req = parse(
        Api.COMPLETIONS,
        {"model": "m", "prompt": "p", "cache_salt": "tenant-7", "stream": True},
        headers={"x-session-id": "s-1"},
        session_header="x-session-id",
    )
    assert (req.cache_salt, req.stream, req.session_key) == ("tenant-7", True, "s-1")
    assert parse(Api.COMPLETIONS, {"model": "m", "prompt": "p"}).session_key is None


def test_empty_prompt_is_valid() -> None:
    assert parse(Api.COMPLETIONS, {"model": "m", "prompt": ""}).prompt == ""
    assert parse(Api.CHAT_COMPLETIONS, {"model": "m", "messages": []}).prompt == ""


@pytest.mark.parametrize(
    ("api", "body", "code", "fragment"),
    [
        pytest.param(
            Api.COMPLETIONS, b"{not json", "invalid_json", "not valid JSON", id="not-json"
        ),
        pytest.param(
            Api.COMPLETIONS,
            b'{"model": "m", "prompt": "a"',
            "invalid_json",
            "not valid JSON",
            id="truncated",
        ),
        pytest.param(Api.COMPLETIONS, b"", "invalid_json", "empty", id="empty-body"),
        pytest.param(Api.COMPLETIONS, b"[1, 2]", "invalid_json", "got an array", id="array"),
        pytest.param(Api.COMPLETIONS, b'"s"', "invalid_json", "got a string", id="string"),
        pytest.param(
            Api.COMPLETIONS, {"prompt": "p"}, "missing_model", "no 'model'", id="missing-model"
        ),
        pytest.param(
            Api.COMPLETIONS,
            {"model": 3, "prompt": "p"},
            "invalid_type",
            "'model' must be",
            id="model-number",
        ),
        pytest.param(
            Api.COMPLETIONS,
            {"model": "", "prompt": "p"},
            "invalid_type",
            "'model' must be",
            id="model-empty",
        ),
        pytest.param(
            Api.COMPLETIONS, {"model": "m"}, "missing_field", "no 'prompt'", id="missing-prompt"
        ),
        pytest.param(
            Api.COMPLETIONS,
            {"model": "m", "prompt": 7},
            "invalid_type",
            "'prompt' must be",
            id="prompt-number",
        ),
        pytest.param(
            Api.COMPLETIONS,
            {"model": "m", "prompt": ["a", 1]},
            "invalid_type",
            "'prompt' must be",
            id="prompt-mixed-list",
        ),
        pytest.param(
            Api.COMPLETIONS,
            {"model": "m", "prompt": "p", "stream": "maybe"},
            "invalid_type",
            "'stream'",
            id="stream-string",
        ),
        pytest.param(
            Api.COMPLETIONS,
            {"model": "m", "prompt": "p", "cache_salt": 5},
            "invalid_type",
            "'cache_salt'",
            id="salt-number",
        ),
        pytest.param(
            Api.CHAT_COMPLETIONS,
            {"model": "m"},
            "missing_field",
            "no 'messages'",
            id="missing-messages",
        ),
        pytest.param(
            Api.CHAT_COMPLETIONS,
            {"model": "m", "messages": "hi"},
            "invalid_type",
            "'messages' must be a list",
            id="messages-string",
        ),
        pytest.param(
            Api.RESPONSES, {"model": "m"}, "missing_field", "no 'input'", id="missing-input"
        ),
        pytest.param(
            Api.RESPONSES,
            {"model": "m", "input": 3},
            "invalid_type",
            "'input' must be",
            id="input-number",
        ),
        pytest.param(
            Api.RESPONSES,
            {"model": "m", "input": {"role": "user"}},
            "invalid_type",
            "'input' must be",
            id="input-object",
        ),
        pytest.param(
            Api.COMPLETIONS,
            b'{"model": "m", "prompt": "\xff\xfe"}',
            "invalid_encoding",
            "not valid UTF-8",
            id="non-utf8",
        ),
    ],
)
def test_bad_requests_get_specific_errors(
    api: Api, body: object, code: str | None, fragment: str
) -> None:
    with pytest.raises(BadRequest) as info:
        parse(api, body)
    assert info.value.http_status == 400
    if code is not None:
        assert info.value.code == code
    assert fragment in info.value.message
    error = orjson.loads(info.value.to_body())["error"]
    assert error["type"] == "invalid_request_error" and error["message"] == info.value.message


def test_oversize_body_is_413() -> None:
    with pytest.raises(BodyTooLarge) as info:
        parse_request("/v1/completions", b"{" + b" " * 100 + b"}", max_body_bytes=50)
    assert info.value.http_status == 413 and "over the limit of 50 bytes" in info.value.message


def test_path_selects_api_and_unknown_path_is_rejected() -> None:
    assert api_for_path("/v1/chat/completions?x=1") is Api.CHAT_COMPLETIONS
    assert api_for_path("/v1/responses/") is Api.RESPONSES
    with pytest.raises(BadRequest, match="unsupported endpoint '/v1/embeddings'"):
        api_for_path("/v1/embeddings")
