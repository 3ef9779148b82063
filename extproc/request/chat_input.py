"""A chat or responses request -> the variables its chat template is rendered with, as
vLLM 0.32 builds them (``request.tokens`` renders and tokenizes them).

vLLM's path: a responses request is turned into chat messages
(``entrypoints/openai/responses/utils.py``, ``construct_input_messages``); messages are
normalized (``renderers/chat_utils.py``, ``parse_chat_messages``, for templates that
take string content, such as Qwen's and Llama's); then ``renderers/hf.py``
(``safe_apply_chat_template``) and Hugging Face's ``apply_chat_template`` render them.
The rules kept here:

* responses ``input``: a string is one user message; list items become messages:
  an item with a ``role`` as it is, except an assistant message, which keeps the first
  content part's text only; a ``reasoning`` item (its first content text, else its first
  summary text), a ``function_call`` or ``custom_tool_call`` fills that field of the
  assistant message just before it when the field is empty, else starts a new one;
  ``function_call_output`` and ``custom_tool_call_output`` are ``tool`` messages. A
  non-empty ``instructions`` is a system message first. A last assistant message or
  reasoning item ``in_progress`` or ``incomplete`` is continued, not answered.
* responses tools: function tools as chat tools, namespace functions flattened to
  ``<namespace>__<name>``, custom tools as a one-string function; other tools dropped.
  ``reasoning.effort`` sets ``enable_thinking`` (false for ``none``) unless the
  request's ``chat_template_kwargs`` do.
* every message: text parts joined with newlines (a null text or refusal part skipped);
  a system message loses a leading Claude Code billing-header line; an assistant
  message keeps ``tool_calls`` (arguments parsed from JSON, anything but an object
  becoming ``{}``) and ``reasoning`` (chat's older ``reasoning_content`` read as it),
  passed as both names; a tool message ``tool_call_id``; ``name`` and ``task``
  strings stay; nothing else does. Developer
  messages become system ones, all merged first, when the template has no developer
  role (``developer_to_system``).
* template variables: the request's ``chat_template_kwargs``, overridden by the
  request's own fields (``add_generation_prompt``...) where those are set; the tools
  unless the kwargs set them. Continuing the final message renders it with a marker and
  cuts the text there (``request.tokens``).

What vLLM refuses, or what it renders from state or data a router does not have
(multimodal parts, ``previous_response_id``, item references, gpt-oss's harmony format,
prompt truncation, a request's own template), raises ``NotExact``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The text each text-like content part carries (vLLM's ``TEXT_PART_TYPES``).
TEXT_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
SKIP_NULL = ("text", "refusal")  # parts skipped, not refused, when their text is null
BILLING_HEADER = "x-anthropic-billing-header"
UNSET = (None, "auto")  # vLLM's ``merge_kwargs``: such a value does not override
NAMESPACE_SEPARATOR = "__"
CUSTOM_TOOL_INPUT_KEY = "input"
CONTINUED = ("in_progress", "incomplete")
# kwargs vLLM or Hugging Face refuse (or would pass twice) in chat_template_kwargs
REFUSED_KWARGS = frozenset({"chat_template", "tokenize", "conversation", "messages"})
# apply_chat_template's own parameters: never template variables
HF_PARAMETERS = frozenset(
    {"padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


class NotExact(Exception):
    """The request cannot be tokenized as the engine will; the message says why."""


@dataclass(frozen=True, slots=True)
class ChatInput:
    """What the template is rendered with."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    variables: dict[str, Any]  # add_generation_prompt, documents and the request's kwargs
    continue_final: bool  # cut the text after the last message's content


# Requests ------------------------------------------------------------------------------


def chat_input(body: Mapping[str, Any]) -> ChatInput:
    """A ``/v1/chat/completions`` body's template input."""
    if body.get("chat_template") is not None:
        raise NotExact("the request brings its own chat template")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise NotExact("no messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise NotExact("'tools' is not a list")
    effort = body.get("reasoning_effort")
    extras = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": effort,
    }
    return _chat_input(
        [conversation_message(_reasoning_renamed(m)) for m in messages],
        None if tools is None else [_chat_tool(t) for t in tools],
        body.get("chat_template_kwargs"),
        extras,
        effort,
        keep_unset=False,
    )


def responses_input(body: Mapping[str, Any]) -> ChatInput:
    """A ``/v1/responses`` body's template input."""
    for field in ("previous_response_id", "prompt"):
        if body.get(field) is not None:
            raise NotExact(f"'{field}' needs state only the engine has")
    if body.get("truncation") not in (None, "disabled"):
        raise NotExact("the prompt may be truncated")
    request_input = body.get("input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise NotExact("'instructions' is not a string")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(request_input, str):
        messages.append({"role": "user", "content": request_input})
        continue_final = False
    elif isinstance(request_input, list):
        for item in request_input:
            message = _item_message(item, messages[-1] if messages else None)
            if message is not None:
                messages.append(message)
        continue_final = _continues(request_input)
    else:
        raise NotExact("'input' is neither a string nor a list")
    if not messages:
        raise NotExact("no messages")
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    extras = {
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
        "reasoning_effort": effort,
    }
    return _chat_input(
        [conversation_message(m) for m in messages],
        _responses_tools(body.get("tools")),
        body.get("chat_template_kwargs"),
        extras,
        effort,
        keep_unset=True,
    )


def _chat_input(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    user_kwargs: Any,
    extras: dict[str, Any],
    effort: Any,
    keep_unset: bool,
) -> ChatInput:
    """The template variables as vLLM merges them (``build_chat_params``, then
    ``preprocess_chat``): user kwargs, overridden by the set request fields; the
    tools, overridden by the user's set kwargs. Responses merge once more, which keeps
    the user's unset (null, ``"auto"``) kwargs (``keep_unset``); chat drops them."""
    user = {} if user_kwargs is None else user_kwargs
    if not isinstance(user, dict):
        raise NotExact("'chat_template_kwargs' is not an object")
    if refused := REFUSED_KWARGS & user.keys():
        raise NotExact(f"'chat_template_kwargs' sets {sorted(refused)}")
    if effort is not None and "enable_thinking" not in user:
        extras = {**extras, "enable_thinking": effort != "none"}
    merged = user | _set(extras)
    base = merged if keep_unset else {}
    variables = base | ({"tools": tools} if tools is not None else {}) | _set(merged)
    for name in HF_PARAMETERS:
        variables.pop(name, None)
    tools = variables.pop("tools", None)
    continue_final = bool(variables.pop("continue_final_message", False))
    variables.setdefault("add_generation_prompt", False)
    variables.setdefault("documents", None)
    if continue_final and variables["add_generation_prompt"]:
        raise NotExact("continue_final_message with add_generation_prompt")
    return ChatInput(messages, tools, variables, continue_final)


def _reasoning_renamed(message: Any) -> Any:
    """Chat's older ``reasoning_content`` is read as ``reasoning`` (vLLM's validator)."""
    if not isinstance(message, dict) or message.get("reasoning") is not None:
        return message
    reasoning = message.get("reasoning_content")
    return message if reasoning is None else {**message, "reasoning": reasoning}


def _set(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v not in UNSET}


# Responses items -----------------------------------------------------------------------


def _item_message(item: Any, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """One input item as a message, or None when it filled ``prev`` instead."""
    if not isinstance(item, dict):
        raise NotExact("an input item is not an object")
    kind = item.get("type")
    prev_assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    if kind in ("function_call", "custom_tool_call"):
        return _merge(prev_assistant, "tool_calls", _tool_call(item))
    if kind == "reasoning":
        return _merge(prev_assistant, "reasoning", _reasoning(item))
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if kind not in (None, "message") or not isinstance(item.get("role"), str):
        raise NotExact(f"input items of type {kind!r} are not rendered exactly")
    if item["role"] != "assistant":
        return dict(item)
    content = item.get("content")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
    else:
        text = content
    if not isinstance(text, str):
        raise NotExact("an assistant message has no text to keep")
    return _merge(prev_assistant, "content", text)


def _merge(prev: dict[str, Any] | None, field: str, value: Any) -> dict[str, Any] | None:
    if field == "tool_calls":
        if prev is None:
            return {"role": "assistant", "tool_calls": [value]}
        calls = prev.get("tool_calls")
        if calls is None:
            prev["tool_calls"] = [value]
        elif isinstance(calls, list):
            calls.append(value)
        else:
            raise NotExact("an assistant message has tool_calls that are not a list")
        return None
    if prev is not None and prev.get(field) is None:
        prev[field] = value
        return None
    return {"role": "assistant", field: value}


def _tool_call(item: dict[str, Any]) -> dict[str, Any]:
    name, call_id = item.get("name"), item.get("call_id")
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise NotExact("a tool call item lacks its name or call_id")
    arguments = item.get("arguments")
    if item["type"] == "custom_tool_call":
        payload = item.get("input") or ""
        arguments = json.dumps({CUSTOM_TOOL_INPUT_KEY: payload}, ensure_ascii=False)
    else:
        if not isinstance(arguments, str):
            raise NotExact("a function_call's arguments are not a string")
        namespace = item.get("namespace")
        if namespace:
            name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
    return {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning(item: dict[str, Any]) -> str:
    if item.get("encrypted_content"):
        raise NotExact("encrypted reasoning")
    content, summary = item.get("content"), item.get("summary")
    if not isinstance(summary, list):
        raise NotExact("a reasoning item without a summary list")
    for parts in (content, summary):
        if isinstance(parts, list) and parts:
            text = parts[0].get("text") if isinstance(parts[0], dict) else None
            if not isinstance(text, str):
                raise NotExact("a reasoning part has no text")
            return text
    return ""


def _continues(items: list[Any]) -> bool:
    """vLLM's ``should_continue_final_message``."""
    last = items[-1] if items else None
    if not isinstance(last, dict) or last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in CONTINUED


# Tools ---------------------------------------------------------------------------------


def _function_tool(function: Mapping[str, Any], defer_loading: Any = None) -> dict[str, Any]:
    """vLLM's ``ChatCompletionToolsParam.model_dump()``."""
    name = function.get("name")
    if not isinstance(name, str):
        raise NotExact("a tool has no name")
    out: dict[str, Any] = {
        "name": name,
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        out["strict"] = function["strict"]
    defer = function.get("defer_loading")
    if defer is None:
        defer = defer_loading
    if defer is not None:
        out["defer_loading"] = defer
    return {"type": "function", "function": out}


def _chat_tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise NotExact("a tool is not a function tool")
    return _function_tool(tool["function"], tool.get("defer_loading"))


def _responses_tools(tools: Any) -> list[dict[str, Any]] | None:
    """vLLM's ``construct_tool_dicts`` (``get_function_tools``)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise NotExact("'tools' is not a list of objects")
    out: list[dict[str, Any]] = []
    for tool in tools:
        kind = tool.get("type")
        if kind == "function":
            out.append(_function_tool(tool))
        elif kind == "custom":
            if tool.get("format") not in (None, {"type": "text"}):
                raise NotExact("a custom tool with a grammar")
            shim = {"name": tool.get("name"), "description": tool.get("description")}
            out.append(_function_tool({**shim, "parameters": _custom_parameters()}))
        elif kind == "namespace":
            inners = tool.get("tools")
            if not isinstance(inners, list):
                raise NotExact("a namespace tool without a list of tools")
            for inner in inners:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    flat = f"{tool.get('name')}{NAMESPACE_SEPARATOR}{inner.get('name')}"
                    out.append(_function_tool({**inner, "name": flat}))
    return out


def _custom_parameters() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            CUSTOM_TOOL_INPUT_KEY: {
                "type": "string",
                "description": "The freeform text payload for this tool.",
            }
        },
        "required": [CUSTOM_TOOL_INPUT_KEY],
        "additionalProperties": False,
    }


# Messages ------------------------------------------------------------------------------


def conversation_message(message: Any) -> dict[str, Any]:
    """One message as vLLM hands it to a string-content template."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise NotExact("a message is not an object with a role")
    role = message["role"]
    content = message.get("content")
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise NotExact("a message's content is neither text nor a list of parts")
    if role == "system":
        parts = _without_billing_header(parts)
    texts = [t for t in map(_part_text, parts) if t is not None]
    out: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            if not isinstance(message["tool_calls"], list):
                raise NotExact("an assistant message's tool_calls are not a list")
            calls = [_parsed_call(c) for c in message["tool_calls"]]
            if calls:
                out["tool_calls"] = calls
        if (reasoning := message.get("reasoning")) is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    for field in ("name", "task"):
        if isinstance(message.get(field), str):
            out[field] = message[field]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str) or kind not in TEXT_FIELDS or part.get("uuid") is not None:
        raise NotExact("a message has a non-text (multimodal) part")
    text = part.get(TEXT_FIELDS[kind])
    if text is None and kind in SKIP_NULL:
        return None
    if not isinstance(text, str):
        raise NotExact("a text part without text")
    return text


def _without_billing_header(parts: list[Any]) -> list[Any]:
    """A Claude Code header line changes every request; vLLM drops it from the text
    (plain or ``text``-typed) parts of system messages."""
    out: list[Any] = []
    for part in parts:
        plain = isinstance(part, str)
        typed = isinstance(part, dict) and part.get("type") == "text"
        text = part if plain else part.get("text") if typed else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if plain else {**part, "text": rest})
    return out


def _parsed_call(call: Any) -> dict[str, Any]:
    """vLLM's ``_postprocess_messages``: arguments as an object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise NotExact("an assistant tool call that is not a function call")
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}


def developer_to_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template without a developer role: developer messages become system ones,
    and every system message is merged into one, first (``_consolidate_system_messages``)."""
    if not any(m["role"] == "developer" for m in messages):
        return messages
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        if m["role"] == "developer"
        else m
        for m in messages
    ]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if systems == [0] or not systems:
        return converted
    merged = "\n\n".join(c for i in systems if (c := converted[i]["content"]))
    rest = [m for m in converted if m["role"] != "system"]
    return [{"role": "system", "content": merged}, *rest]
