"""Tools on the simulated pods: the catalog, calls and results in the pseudo-tokenizer's
prompt, and forced tool choices answered with a call, whole and streamed, as vLLM
(``--tool-call-parser hermes``) answers them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.sim.api import ApiError, parse_request
from extproc.sim.launch import SimPods
from extproc.sim.tokenizer import (
    IM_END,
    TOOL_CALL,
    TOOL_CALL_END,
    TOOL_RESPONSE,
    ChatMessage,
    ToolCall,
    render_chat,
    word_token,
)
from extproc.sim.tool_calls import plan_tool_call, simulated_arguments

PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "unit": {"enum": ["c", "f"]},
        "alerts": {"type": "boolean"},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "tags": {"type": "array"}},
            "required": ["lat", "tags"],
        },
        "note": {"type": "string"},  # optional: left out
    },
    "required": ["city", "days", "unit", "alerts", "where"],
}
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": PARAMETERS},
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object"}},
}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SYSTEM = ChatMessage("system", "You are a helpful assistant.")


def chat(pods: SimPods, **body: Any) -> dict[str, Any]:
    resp = httpx.post(pods.pods[0].url + "/v1/chat/completions", json={"messages": USER, **body})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def chat_chunks(pods: SimPods, **body: Any) -> list[dict[str, Any]]:
    body = {"messages": USER, "stream": True, "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", pods.pods[0].url + "/v1/chat/completions", json=body) as resp:
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


def reassembled(chunks: list[dict[str, Any]]) -> tuple[str, str, list[str | None]]:
    """The name and arguments the streamed ``tool_calls`` deltas add up to, and the
    finish reasons of the chunks with a choice."""
    name, arguments = "", ""
    for chunk in chunks:
        for delta in chunk["choices"][0]["delta"].get("tool_calls", []) if chunk["choices"] else []:
            assert delta["index"] == 0
            name += delta["function"].get("name", "")
            arguments += delta["function"].get("arguments", "")
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    return name, arguments, finishes


# Rendering -----------------------------------------------------------------------------


def test_the_tool_catalog_enters_the_prompt() -> None:
    plain = render_chat([SYSTEM, ChatMessage("user", "hi")])
    with_tools = render_chat([SYSTEM, ChatMessage("user", "hi")], TOOLS)
    one_tool = render_chat([SYSTEM, ChatMessage("user", "hi")], [TIME])
    assert len(with_tools) > len(one_tool) > len(plain)
    assert with_tools[-4:] == plain[-4:]  # the conversation ends alike
    assert plain.count(IM_END) == with_tools.count(IM_END)  # the system text joins the tools


def test_calls_and_results_are_rendered_but_not_their_ids() -> None:
    def rendered(name: str, arguments: str, result: str) -> list[int]:
        return render_chat(
            [
                ChatMessage("user", "hi"),
                ChatMessage("assistant", "", (ToolCall(name, arguments),)),
                ChatMessage("tool", result),
            ],
            TOOLS,
        )

    tokens = rendered("get_time", "{}", "12:00")
    no_call = render_chat([ChatMessage("user", "hi")], TOOLS)  # the system's instructions
    assert tokens.count(TOOL_CALL) == no_call.count(TOOL_CALL) + 1
    assert tokens.count(TOOL_CALL_END) == no_call.count(TOOL_CALL_END) + 1
    assert TOOL_RESPONSE in tokens
    assert rendered("get_weather", "{}", "12:00") != tokens
    assert rendered("get_time", '{"tz": "UTC"}', "12:00") != tokens
    assert rendered("get_time", "{}", "13:00") != tokens
    # ids are what chat_input keeps, and what Qwen3's template leaves out
    body = {"model": "m", "tools": TOOLS, "messages": [
        *USER,
        {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                              "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "12:00"},
    ]}  # fmt: skip
    other = json.loads(json.dumps(body).replace('"a"', '"b"'))
    assert (
        parse_request("chat", body, "m", 4).prompt_token_ids
        == parse_request("chat", other, "m", 4).prompt_token_ids
    )


@settings(deadline=None, max_examples=50)
@given(
    st.text(min_size=1, max_size=12),
    st.sampled_from(["get_weather", "get_time"]),
    st.integers(0, 2**32),
    st.text(max_size=30),
)
def test_a_tool_turn_extends_the_previous_prompt_and_call(
    question: str, name: str, seed: int, result: str
) -> None:
    history = [SYSTEM, ChatMessage("user", question)]
    prompt = render_chat(history, TOOLS)
    call = plan_tool_call(TOOLS, name, prompt, seed)
    generated = [word_token(w) for w in call.words]
    assert generated[-1] == IM_END
    turn = ChatMessage("assistant", "", (ToolCall(call.name, call.arguments),))
    next_prompt = render_chat([*history, turn, ChatMessage("tool", result)], TOOLS)
    assert next_prompt[: len(prompt) + len(generated)] == prompt + generated


def test_a_call_whose_bytes_straddle_chunks_re_renders_to_its_tokens() -> None:
    tools = [{"type": "function", "function": {"name": "say", "parameters": {
        "type": "object", "properties": {"w": {"const": "héllo wörld ✓"}}, "required": ["w"]}}}]  # fmt: skip
    prompt = render_chat([ChatMessage("user", "x")], tools)
    call = plan_tool_call(tools, "say", prompt, 0)
    turn = ChatMessage("assistant", "", (ToolCall(call.name, call.arguments),))
    next_prompt = render_chat([ChatMessage("user", "x"), turn, ChatMessage("user", "y")], tools)
    generated = [word_token(w) for w in call.words]
    assert next_prompt[: len(prompt) + len(generated)] == prompt + generated
    assert call.text(len(call.words)).endswith('"héllo wörld ✓"}}\n</tool_call>')


# Arguments -----------------------------------------------------------------------------


def test_arguments_follow_the_schema_and_the_prompt() -> None:
    args = simulated_arguments(PARAMETERS, [1, 2, 3])
    assert set(args) == {"city", "days", "unit", "alerts", "where"}
    assert isinstance(args["city"], str) and args["city"]
    assert isinstance(args["days"], int) and not isinstance(args["days"], bool)
    assert args["unit"] in ("c", "f")
    assert isinstance(args["alerts"], bool)
    assert set(args["where"]) == {"lat", "tags"} and isinstance(args["where"]["tags"], list)
    assert simulated_arguments(PARAMETERS, [1, 2, 3]) == args
    others = [simulated_arguments(PARAMETERS, [1, 2, n]) for n in range(4, 12)]
    assert any(o != args for o in others)
    assert simulated_arguments(None, [1]) == {}
    assert simulated_arguments({"type": ["null", "integer"]}, [1]) in range(100)


# Answers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tool_choice", "name", "finish"),
    [
        pytest.param(NAMED, "get_weather", "stop", id="named"),
        pytest.param("required", None, "tool_calls", id="required"),
    ],
)
def test_a_forced_choice_gets_a_call(
    pods: SimPods, tool_choice: Any, name: str | None, finish: str
) -> None:
    body = chat(pods, tools=TOOLS, tool_choice=tool_choice, max_tokens=200)
    (choice,) = body["choices"]
    message = choice["message"]
    assert message["content"] == ""
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == (name or call["function"]["name"])
    arguments = json.loads(call["function"]["arguments"])
    tool = next(t for t in TOOLS if t["function"]["name"] == call["function"]["name"])
    assert set(arguments) == set(tool["function"]["parameters"].get("required", []))
    assert choice["finish_reason"] == finish
    planned = parse_request(
        "chat", {"messages": USER, "tools": TOOLS, "tool_choice": tool_choice}, "sim-llm", 16
    ).tool_call
    assert planned is not None
    assert body["usage"]["completion_tokens"] == len(planned.words)  # the call, then <|im_end|>


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"tools": TOOLS}, id="absent"),
        pytest.param({"tools": TOOLS, "tool_choice": "auto"}, id="auto"),
        pytest.param({"tools": TOOLS, "tool_choice": "none"}, id="none"),
    ],
)
def test_unforced_choices_get_text(pods: SimPods, extra: dict[str, Any]) -> None:
    (choice,) = chat(pods, max_tokens=5, **extra)["choices"]
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"] and choice["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("tool_choice", "finish"),
    [
        pytest.param(NAMED, "stop", id="named"),
        pytest.param("required", "tool_calls", id="required"),
    ],
)
def test_streamed_deltas_add_up_to_the_call(pods: SimPods, tool_choice: Any, finish: str) -> None:
    extra = {"tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 200, "seed": 7}
    whole = chat(pods, **extra)["choices"][0]["message"]["tool_calls"][0]["function"]
    chunks = chat_chunks(pods, **extra)
    first = next(c for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"])
    head = first["choices"][0]["delta"]["tool_calls"][0]
    assert head["type"] == "function" and head["id"].startswith("chatcmpl-tool-")
    assert head["function"] == {"name": whole["name"]}
    name, arguments, finishes = reassembled(chunks)
    assert (name, arguments) == (whole["name"], whole["arguments"])
    json.loads(arguments)
    assert (
        finishes[0] is None and finishes[-1] == finish and finishes.count(None) == len(finishes) - 1
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 10
    # a token the parser holds back (markup, the end-of-turn token) sends no chunk
    choices = [c["choices"][0] for c in chunks[1:] if c["choices"]]
    assert all(c["delta"].get("tool_calls") or c["finish_reason"] for c in choices)


def test_max_tokens_cuts_a_call_as_vllm_does(pods: SimPods) -> None:
    planned = parse_request(
        "chat", {"messages": USER, "tools": TOOLS, "tool_choice": NAMED}, "sim-llm", 16
    ).tool_call
    assert planned is not None
    num_words = len(planned.words)
    # all but the end-of-turn token: the call is whole, the finish is the limit's
    (choice,) = chat(pods, tools=TOOLS, tool_choice=NAMED, max_tokens=num_words - 1)["choices"]
    assert choice["finish_reason"] == "length" and len(choice["message"]["tool_calls"]) == 1
    # cut inside the JSON: the partial text is the content, as the parser leaves it
    (choice,) = chat(pods, tools=TOOLS, tool_choice=NAMED, max_tokens=8)["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith('<tool_call>\n{"name": "get_weather"')
    chunks = chat_chunks(pods, tools=TOOLS, tool_choice=NAMED, max_tokens=12)
    name, _, finishes = reassembled(chunks)
    assert name == "get_weather" and finishes[-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_the_next_turn_hits_the_cache_through_the_call(pods: SimPods) -> None:
    system = {"role": "system", "content": "You are the weather desk. " * 10}
    messages: list[dict[str, Any]] = [system, *USER]
    first = chat(pods, messages=messages, tools=TOOLS, tool_choice=NAMED, max_tokens=200)
    num_prompt = first["usage"]["prompt_tokens"]
    num_output = first["usage"]["completion_tokens"]
    call = first["choices"][0]["message"]["tool_calls"][0]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "clear"}'},
    ]
    second = chat(pods, messages=messages, tools=TOOLS, max_tokens=3)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the prompt and the call but its last token were computed, so cached in full blocks
    assert cached == (num_prompt + num_output - 1) // 16 * 16


def test_responses_get_a_function_call(pods: SimPods) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
    body = {"input": USER[0]["content"], "tools": [tool], "max_output_tokens": 200,
            "tool_choice": {"type": "function", "name": "get_weather"}}  # fmt: skip
    resp = httpx.post(pods.pods[0].url + "/v1/responses", json=body).json()
    assert resp["status"] == "completed" and resp["incomplete_details"] is None
    (item,) = resp["output"]
    assert item["type"] == "function_call" and item["status"] == "completed"
    assert item["name"] == "get_weather" and item["call_id"].startswith("chatcmpl-tool-")
    assert set(json.loads(item["arguments"])) == set(PARAMETERS["required"])
    assert resp["tool_choice"] == body["tool_choice"] and resp["tools"] == [tool]
    with httpx.stream(
        "POST", pods.pods[0].url + "/v1/responses", json={**body, "stream": True}
    ) as r:
        events = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    types = [e["type"] for e in events]
    deltas = types.count("response.function_call_arguments.delta")
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    arguments = "".join(e["delta"] for e in events if e["type"].endswith("arguments.delta"))
    assert arguments == events[-3]["arguments"] == item["arguments"]
    assert events[-1]["response"]["output"] == [events[-2]["item"]]


# Errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message", "param", "err_type"),
    [
        pytest.param({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                     "The tool specified in `tool_choice` does not match any of the specified "
                     "`tools` (parameter=tool_choice)", "tool_choice", "BadRequestError",
                     id="unknown-function"),
        pytest.param({"tools": [], "tool_choice": "auto"},
                     "`tools` must not be an empty array.", "tools", "BadRequestError",
                     id="empty-tools"),
        pytest.param({"tool_choice": "required"},
                     "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)",
                     "tool_choice", "BadRequestError", id="choice-without-tools"),
        pytest.param({"tools": TOOLS, "tool_choice": "always"},
                     "Invalid value for `tool_choice`: always! Only named tools",
                     "tool_choice", "BadRequestError", id="bad-choice"),
        pytest.param({"tools": TOOLS, "tool_choice": {"type": "function"}},
                     "Invalid value for `function`: `None` in `tool_choice`!",
                     "tool_choice.function", "BadRequestError", id="choice-without-function"),
        pytest.param({"tools": ["x"]}, "1 validation error:", "body.tools.0", "Bad Request",
                     id="tool-not-an-object"),
        pytest.param({"tools": [{"type": "function", "function": {"parameters": {}}}]},
                     "'missing'", "body.tools.0.function.name", "Bad Request",
                     id="tool-without-name"),
    ],
)  # fmt: skip
def test_malformed_tools_get_vllms_errors(
    pods: SimPods, body: dict[str, Any], message: str, param: str, err_type: str
) -> None:
    resp = httpx.post(pods.pods[0].url + "/v1/chat/completions", json={"messages": USER, **body})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert message in error["message"]
    assert (error["param"], error["type"], error["code"]) == (param, err_type, 400)


@pytest.mark.parametrize(
    ("tools", "tool_choice"),
    [
        pytest.param([{"type": "function", "name": "f"}], {"type": "function", "name": "g"},
                     id="unknown-function"),
        pytest.param(None, {"type": "function", "name": "g"}, id="no-tools"),
    ],
)  # fmt: skip
def test_responses_naming_an_unknown_function_is_refused(tools: Any, tool_choice: Any) -> None:
    body = {"input": "hi", "tools": tools, "tool_choice": tool_choice}
    with pytest.raises(ApiError) as err:
        parse_request("responses", body, "m", 4)
    assert err.value.status == 400 and err.value.param == "tool_choice"
    assert "Tool choice 'function' not found in 'tools' parameter." in err.value.message
