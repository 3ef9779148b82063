"""Chat and responses bodies with the text vLLM 0.32 renders for each (the Qwen3 template
of the e2e model), as its ``/v1/responses/render`` and ``/v1/chat/completions/render``
returned them, decoded: ``test_chat_input.py`` renders them with extproc's tokenizer,
``e2e/real_vllm/test_precise.py`` sends them to a real pod again."""

from __future__ import annotations

from typing import Any

import pytest

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
