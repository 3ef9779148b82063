"""Chat and responses requests render to the text vLLM 0.32 renders for them (the Qwen3
template of the e2e model), and what vLLM refuses or renders from state a router lacks
is ``NotExact``.

Every expected text below is what vLLM 0.32's ``/v1/responses/render`` or
``/v1/chat/completions/render`` returned for that body, decoded;
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

MODEL_DIR = Path.home() / ".cache/extproc-e2e/model/qwen3-tiny"
pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "tokenizer.json").exists(), reason="run `python -m e2e.real_vllm.prepare`"
)

ANSWER = "<|im_start|>assistant\n"
NO_THINKING = ANSWER + "<think>\n\n</think>\n\n"


def im(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def tools_system(*tools: str) -> str:
    """Qwen3's system turn listing ``tools`` (JSON, one a line)."""
    return im(
        "system",
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(tools)
        + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    )


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def output_text(text: str, **more: Any) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", **more,
            "content": [{"type": "output_text", "text": text}]}  # fmt: skip


def reasoning(text: str, **more: Any) -> dict[str, Any]:
    return {"type": "reasoning", "summary": [], **more,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def fn_call(call_id: str, arguments: str, **more: str) -> dict[str, str]:
    return {"type": "function_call", "call_id": call_id, "name": "get", "arguments": arguments,
            **more}  # fmt: skip


def fn_output(call_id: str, output: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


RESPONSES_CASES = [
    pytest.param({"input": "Hi there"}, im("user", "Hi there") + ANSWER, id="string-input"),
    pytest.param(
        {"instructions": "Be brief.", "input": "Hi"},
        im("system", "Be brief.") + im("user", "Hi") + ANSWER,
        id="instructions-first",
    ),
    pytest.param(
        {"instructions": "", "input": "Hi"}, im("user", "Hi") + ANSWER, id="empty-instructions"
    ),
    pytest.param(
        {
            "input": [
                user("q1"),
                {"type": "message", "role": "assistant", "content": "a1"},
                user("q2"),
            ]
        },
        im("user", "q1") + im("assistant", "a1") + im("user", "q2") + ANSWER,
        id="message-items",
    ),
    pytest.param(
        {
            "input": [
                user("q"),
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [
                        {"type": "output_text", "text": "p1"},
                        {"type": "output_text", "text": "p2"},
                    ],
                },
                user("q2"),
            ]
        },
        im("user", "q") + im("assistant", "p1") + im("user", "q2") + ANSWER,
        id="assistant-keeps-its-first-part",
    ),
    pytest.param(
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "a"},
                        {"type": "input_text", "text": "b <|im_end|> c"},
                    ],
                }
            ]
        },
        im("user", "a\nb <|im_end|> c") + ANSWER,
        id="text-parts-joined",
    ),
    pytest.param(
        {"instructions": "ins", "input": [user("q"), {"role": "developer", "content": "dev"}]},
        im("system", "ins\n\ndev") + im("user", "q") + ANSWER,
        id="developer-merged-into-system",
    ),
    pytest.param(
        {
            "input": [
                user("q"),
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}]},
                fn_call("c1", '{"x": 1}'),
                fn_call("c2", "not json"),
                fn_output("c1", "r1"),
                fn_output("c2", "r2"),
            ]
        },
        im("user", "q")
        + im(
            "assistant",
            "<think>\nsum\n</think>\n\n" + call("get", '{"x": 1}') + "\n" + call("get", "{}"),
        )
        + im("user", "<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response>")
        + ANSWER,
        id="reasoning-and-calls-merge",
    ),
    pytest.param(
        {
            "input": [
                user("q"),
                reasoning("full", summary=[{"type": "summary_text", "text": "sum"}]),
                output_text("ans"),
            ]
        },
        im("user", "q") + im("assistant", "<think>\nfull\n</think>\n\nans") + ANSWER,
        id="reasoning-content-before-summary",
    ),
    pytest.param(
        {
            "input": [
                user("q"),
                {"role": "assistant", "content": "let me"},
                fn_call("c1", "{}", namespace="ns"),
                fn_output(
                    "c1",
                    [{"type": "input_text", "text": "r1"}, {"type": "input_text", "text": "r2"}],
                ),
            ]
        },
        im("user", "q")
        + im("assistant", "let me\n" + call("ns__get", "{}"))
        + im("user", "<tool_response>\nr1\nr2\n</tool_response>")
        + ANSWER,
        id="namespaced-call-and-output-parts",
    ),
    pytest.param(
        {
            "input": [
                user("q"),
                {"type": "custom_tool_call", "call_id": "c1", "name": "shell", "input": 'ls "ü"'},
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "files"},
            ]
        },
        im("user", "q")
        + im("assistant", call("shell", '{"input": "ls \\"ü\\""}'))
        + im("user", "<tool_response>\nfiles\n</tool_response>")
        + ANSWER,
        id="custom-tool-call",
    ),
    pytest.param(
        {
            "input": "hi",
            "tools": [
                {
                    "type": "function",
                    "name": "get",
                    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
                },
                {
                    "type": "function",
                    "name": "put",
                    "description": "Put it.",
                    "strict": True,
                    "defer_loading": True,
                },
                {"type": "custom", "name": "shell", "description": "run"},
                {"type": "web_search"},
                {
                    "type": "namespace",
                    "name": "ns",
                    "description": "d",
                    "tools": [
                        {"type": "function", "name": "get", "parameters": {"type": "object"}}
                    ],
                },
            ],
        },
        tools_system(
            '{"type": "function", "function": {"name": "get", "description": null, '
            '"parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}',
            '{"type": "function", "function": {"name": "put", "description": "Put it.", '
            '"parameters": null, "strict": true, "defer_loading": true}}',
            '{"type": "function", "function": {"name": "shell", "description": "run", '
            '"parameters": {"type": "object", "properties": {"input": {"type": "string", '
            '"description": "The freeform text payload for this tool."}}, "required": '
            '["input"], "additionalProperties": false}}}',
            '{"type": "function", "function": {"name": "ns__get", "description": null, '
            '"parameters": {"type": "object"}}}',
        )
        + im("user", "hi")
        + ANSWER,
        id="tools",
    ),
    pytest.param(
        {"input": "hi", "reasoning": {"effort": "none"}},
        im("user", "hi") + NO_THINKING,
        id="effort-none-no-thinking",
    ),
    pytest.param(
        {
            "input": "hi",
            "reasoning": {"effort": "none"},
            "chat_template_kwargs": {"enable_thinking": True},
        },
        im("user", "hi") + ANSWER,
        id="kwargs-beat-effort",
    ),
    pytest.param(
        {
            "input": "hi",
            "chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": False},
        },
        im("user", "hi") + NO_THINKING,
        id="kwargs-lose-to-fields",
    ),
    pytest.param(
        {"input": [user("q"), output_text("Once upon", status="in_progress")]},
        im("user", "q") + NO_THINKING + "Once upon",
        id="continue-assistant",
    ),
    pytest.param(
        {"input": [user("q"), reasoning("hmm", status="incomplete")]},
        im("user", "q") + ANSWER + "<think>\nhmm\n</think>\n\n",
        id="continue-reasoning",
    ),
    pytest.param(
        {
            "input": [
                {"role": "system", "content": "x-anthropic-billing-header: cch=1\nreal"},
                user("q"),
            ]
        },
        im("system", "real") + im("user", "q") + ANSWER,
        id="billing-header-dropped",
    ),
]

CHAT_CASES = [
    pytest.param(
        {"messages": [{"role": "developer", "content": "d"}, user("q")]},
        im("system", "d") + im("user", "q") + ANSWER,
        id="developer-as-system",
    ),
    pytest.param(
        {
            "messages": [
                user("q"),
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"x":1}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "r"},
            ]
        },
        im("user", "q")
        + im("assistant", call("f", '{"x": 1}'))
        + im("user", "<tool_response>\nr\n</tool_response>")
        + ANSWER,
        id="tool-call-without-content",
    ),
    pytest.param(
        {
            "messages": [
                user("q"),
                {"role": "assistant", "content": "a", "reasoning_content": "old name"},
                {"role": "tool", "content": "t"},
                {"role": "assistant", "content": "b", "reasoning": "new name"},
                {"role": "tool", "content": "t2"},
            ]
        },
        im("user", "q")
        + im("assistant", "<think>\nold name\n</think>\n\na")
        + im("user", "<tool_response>\nt\n</tool_response>")
        + im("assistant", "<think>\nnew name\n</think>\n\nb")
        + im("user", "<tool_response>\nt2\n</tool_response>")
        + ANSWER,
        id="reasoning-under-either-name",
    ),
    pytest.param(
        {
            "messages": [user("q"), {"role": "assistant", "content": "Once upon"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        im("user", "q") + NO_THINKING + "Once upon",
        id="continue-final-message",
    ),
    pytest.param(
        {"messages": [user("q")], "chat_template_kwargs": {"add_generation_prompt": False}},
        im("user", "q") + ANSWER,
        id="kwargs-lose-to-fields",
    ),
    pytest.param(
        {"messages": [user("q")], "reasoning_effort": "none"},
        im("user", "q") + NO_THINKING,
        id="reasoning-effort-none",
    ),
    pytest.param(
        {
            "messages": [user("q")],
            "tool_choice": "none",
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ],
        },
        tools_system(
            '{"type": "function", "function": {"name": "f", "description": null, '
            '"parameters": {"type": "object"}}}'
        )
        + im("user", "q")
        + ANSWER,
        id="tool-without-description",
    ),
]

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
