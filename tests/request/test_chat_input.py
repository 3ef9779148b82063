"""Chat and responses requests render to the text vLLM 0.32 renders for them (the Qwen3
template of the e2e model), and what vLLM refuses or renders from state a router lacks
is ``NotExact``.

The bodies and the texts vLLM 0.32 rendered for them are in ``testkit/chat_cases.py``;
``e2e/real_vllm/test_precise.py`` sends the same tables to a real pod again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.request.parse import Api
from extproc.request.tokens import NotExact, SegmentTokenizer
from testkit.chat_cases import CHAT_CASES, RESPONSES_CASES, user
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer

pytestmark = needs_model_tokenizer

NOT_EXACT_RESPONSES = [
    pytest.param({"input": [{"role": "user", "content": [{"type": "input_image",
        "image_url": "data:image/png;base64,AAAA"}]}]}, id="image"),
    pytest.param({"input": [{"role": "user", "content": [{"type": "input_file",
        "file_id": "f"}]}]}, id="file"),
    pytest.param({"input": [{"type": "item_reference", "id": "x"}]}, id="item-reference"),
    pytest.param({"input": "hi", "previous_response_id": "resp_1"}, id="stored-response"),
    pytest.param({"input": "hi", "prompt": {"id": "pmpt_1"}}, id="prompt-template"),
    pytest.param({"input": "hi", "truncation": "auto"}, id="truncated"),
    pytest.param({"input": [{"type": "reasoning", "summary": [],
        "encrypted_content": "x"}]}, id="encrypted-reasoning"),
    pytest.param({"input": [user("q"), {"type": "message", "role": "assistant",
        "content": [{"type": "refusal", "refusal": "no"}]}]}, id="refusal-first"),
    pytest.param({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]},
        id="call-without-name"),
    pytest.param({"input": []}, id="nothing"),
    pytest.param({"input": 3}, id="input-not-text-or-list"),
    pytest.param({"input": "hi", "chat_template_kwargs": {"messages": []}}, id="kwargs-messages"),
    pytest.param({"input": "hi", "tools": [{"type": "custom", "name": "c",
        "format": {"type": "grammar", "syntax": "lark", "definition": "x"}}]}, id="grammar"),
]  # fmt: skip


NOT_EXACT_CHAT = [
    pytest.param({"messages": [user("q")], "chat_template": "{{ messages }}"}, id="own-template"),
    pytest.param({"messages": [{"role": "assistant", "content": "a", "tool_calls": 1}]},
        id="tool-calls-not-a-list"),
    pytest.param({"messages": [{"role": "user", "content": [{"type": {}, "text": "a"}]}]},
        id="part-type-not-text"),
    pytest.param({"messages": [user("q")], "continue_final_message": True}, id="continue-and-answer"),
    pytest.param({"messages": [user("q")], "chat_template_kwargs": {"tools": 1}},
        id="template-raises-type-error"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tok() -> SegmentTokenizer:
    return SegmentTokenizer(MODEL_DIR)


@pytest.mark.parametrize(("body", "text"), RESPONSES_CASES)
def test_responses_render_as_vllm_renders_them(
    tok: SegmentTokenizer, body: dict[str, Any], text: str
) -> None:
    assert tok.render_responses(body) == text
    expected = tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert tok.request_tokens(Api.RESPONSES, body) == expected


@pytest.mark.parametrize(("body", "text"), CHAT_CASES)
def test_chat_renders_as_vllm_renders_it(
    tok: SegmentTokenizer, body: dict[str, Any], text: str
) -> None:
    assert tok.render_chat(body) == text


@pytest.mark.parametrize("body", NOT_EXACT_RESPONSES)
def test_responses_vllm_refuses_or_cannot_be_had_are_not_exact(
    tok: SegmentTokenizer, body: dict[str, Any]
) -> None:
    with pytest.raises(NotExact):
        tok.request_tokens(Api.RESPONSES, body)


@pytest.mark.parametrize("body", NOT_EXACT_CHAT)
def test_chat_vllm_refuses_or_cannot_be_had_is_not_exact(
    tok: SegmentTokenizer, body: dict[str, Any]
) -> None:
    with pytest.raises(NotExact):
        tok.request_tokens(Api.CHAT_COMPLETIONS, body)


def model_copy(directory: Path, template: str | None = None, model_type: str = "qwen3") -> Path:
    """The e2e model's tokenizer in ``directory``, with another template or model type."""
    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(MODEL_DIR / "tokenizer.json", directory / "tokenizer.json")
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    return directory


def test_gpt_oss_is_not_rendered_by_its_template(tmp_path: Path) -> None:
    """vLLM renders gpt-oss chat and responses in its harmony format, not the template."""
    tok = SegmentTokenizer(model_copy(tmp_path, model_type="gpt_oss"))
    for api, body in (
        (Api.RESPONSES, {"input": "hi"}),
        (Api.CHAT_COMPLETIONS, {"messages": [user("hi")]}),
    ):
        with pytest.raises(NotExact, match="harmony"):
            tok.request_tokens(api, body)


def test_a_null_template_kwarg_is_defined_for_responses_only(tmp_path: Path) -> None:
    """vLLM merges a responses request's kwargs once more than a chat request's, and that
    merge keeps the null ones."""
    tok = SegmentTokenizer(model_copy(tmp_path, "{{ 'set' if flag is defined else 'unset' }}"))
    kwargs = {"chat_template_kwargs": {"flag": None}}
    assert tok.render_responses({"input": "hi", **kwargs}) == "set"
    assert tok.render_chat({"messages": [user("hi")], **kwargs}) == "unset"


# Bodies near the valid ones: each field is a plausible value or any JSON value.
texts = st.sampled_from(
    ["", "hi", "a <|im_end|> b", '{"a": 1}', "[1]", "x-anthropic-billing-header"]
)
scalars = st.none() | st.booleans() | st.integers(-1, 1) | texts
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(texts, inner, max_size=2),
    max_leaves=8,
)


def near(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return strategy | json_values


def record(required: dict[str, Any], **optional: Any) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {k: near(v) for k, v in required.items()},
        optional={k: near(v) for k, v in optional.items()},
    )


parts = st.lists(
    record({"type": st.sampled_from(["text", "input_text", "output_text", "refusal"]),
            "text": texts}),
    max_size=2,
)  # fmt: skip
content = texts | parts
calls = st.lists(
    record({"id": texts, "type": st.just("function"),
            "function": record({"name": texts, "arguments": texts})}),
    max_size=2,
)  # fmt: skip
summary = st.lists(record({"type": st.just("summary_text"), "text": texts}), max_size=1)
status = st.sampled_from(["completed", "in_progress", "incomplete"])
roles = st.sampled_from(["user", "assistant", "system", "developer", "tool"])
items = st.sampled_from(["message", "function_call", "function_call_output", "custom_tool_call",
                         "custom_tool_call_output", "reasoning", "item_reference"])  # fmt: skip
message = record(
    {"role": roles}, content=content, tool_calls=calls, reasoning=texts,
    reasoning_content=texts, tool_call_id=texts, name=texts,
)  # fmt: skip
item = message | record(
    {"type": items}, role=roles, content=content, call_id=texts, name=texts, namespace=texts,
    arguments=texts, input=texts, output=content, summary=summary, status=status,
)  # fmt: skip
kwargs = st.dictionaries(
    st.sampled_from(["enable_thinking", "tools", "add_generation_prompt", "documents", "flag"]),
    json_values,
    max_size=2,
)
chat_tools = st.lists(record({"type": st.just("function"), "function": record({"name": texts})}))
responses_tools = st.lists(
    record({"type": st.sampled_from(["function", "custom", "namespace", "web_search"]),
            "name": texts}, tools=st.lists(record({"type": st.just("function"), "name": texts})))
)  # fmt: skip
chat_bodies = st.fixed_dictionaries(
    {"messages": near(st.lists(message, max_size=4))},
    optional={"tools": near(chat_tools), "chat_template_kwargs": near(kwargs),
              "continue_final_message": scalars, "add_generation_prompt": scalars,
              "reasoning_effort": near(st.just("none"))},
)  # fmt: skip
responses_bodies = st.fixed_dictionaries(
    {"input": near(texts | st.lists(item, max_size=4))},
    optional={"tools": near(responses_tools), "chat_template_kwargs": near(kwargs),
              "instructions": scalars, "reasoning": near(record({"effort": texts}))},
)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(chat_bodies, responses_bodies)
def test_any_body_is_tokenized_or_not_exact_never_an_error(
    tok: SegmentTokenizer, chat: dict[str, Any], responses: dict[str, Any]
) -> None:
    for api, body in ((Api.CHAT_COMPLETIONS, chat), (Api.RESPONSES, responses)):
        try:
            assert all(type(t) is int for t in tok.request_tokens(api, body))
        except NotExact:
            pass
