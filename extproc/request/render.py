"""The prompt text a request is matched on, rendered as Kthena's router renders it.

Kthena's ``ParsePrompt``/``GetPromptString`` (``pkg/kthena-router/utils/utils.go``) read
the body, whatever the path, in this order: a ``prompt`` key (it must be a string), else
a ``messages`` key (it must be a list), else an ``input`` key (a string or a list),
else the request is refused. Messages are rendered in ChatML,
``<|im_start|>{role}\\n{content}<|im_end|>\\n``, and anything Kthena cannot read inside
them is skipped, not refused:

* a message that is not an object, or whose ``role`` is not a string, is skipped;
* ``content`` is a string (kept as is, even empty) or a list of parts of which the
  ``text`` of each object part whose ``type`` is ``text``/``input_text``/``output_text``
  or absent (or not a string) is kept, joined with a newline; a message whose content is
  null, missing, another type, or a list with no text part is dropped (an assistant turn
  with only ``tool_calls``, an image-only turn);
* chat: a top-level ``system`` readable as content comes first as a system message;
* responses: ``instructions``, when a non-empty string, is a ``developer`` message; a
  string ``input`` is a ``user`` message; list items that are objects whose ``type`` is
  ``message``, empty or not a string, with a non-empty string ``role``, keep their role;
  other items (function calls, reasoning, ...) are skipped.

Two ``Rendering`` modes choose how the body's prompt field is found:

* ``KTHENA``: Kthena's order above, the same for every path, to the letter.
* ``EXTENDED`` (extproc's default): the path's own field, so every request vLLM accepts is
  routed: ``/v1/completions`` reads ``prompt``, which may also be a list of strings
  (joined with newlines) or token ids (no text: routed unscored), both of which Kthena
  refuses; ``/v1/chat/completions`` reads ``messages``; ``/v1/responses`` reads
  ``instructions`` and ``input`` and ignores ``prompt`` (an OpenAI prompt-template
  reference there, an object, on which Kthena refuses the request). For the bodies
  Kthena routes, the two modes render the same text wherever the path's field is the
  one Kthena reads first.

What cannot be rendered raises ``BadRequest`` with a message naming the field.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from extproc.errors import BadRequest

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


class Rendering(str, Enum):
    """Where the prompt is read from (module docstring)."""

    EXTENDED = "extended"
    KTHENA = "kthena"


def wrong_type(param: str, expected: str, value: object) -> BadRequest:
    return BadRequest(
        f"'{param}' must be {expected}, got {json_type(value)}", code="invalid_type", param=param
    )


def missing(param: str) -> BadRequest:
    return BadRequest(f"the request has no '{param}' field", code="missing_field", param=param)


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _chatml(parts: list[str], role: str, content: str) -> None:
    """Add one ChatML message to ``parts``, in pieces: the prompt's one join copies the
    content once (a long prompt is mostly one message's content)."""
    parts += ("<|im_start|>", role, "\n", content, "<|im_end|>\n")


def content_text(content: object) -> str | None:
    """A message's text as Kthena reads it, or None when the message is to be dropped."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if isinstance(kind, str) and kind not in TEXT_PART_TYPES:
            continue
        text = part.get("text")
        if isinstance(text, str):
            texts.append(text)
    return "\n".join(texts) if texts else None


def _chat_messages(data: dict[str, Any], messages: list[Any]) -> str:
    parts: list[str] = []
    system = content_text(data.get("system"))
    if system is not None:
        _chatml(parts, "system", system)
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if not isinstance(role, str):
            continue
        text = content_text(message.get("content"))
        if text is not None:
            _chatml(parts, role, text)
    return "".join(parts)


def _responses_input(instructions: object, items: object) -> str:
    parts: list[str] = []
    if isinstance(instructions, str) and instructions:
        _chatml(parts, "developer", instructions)
    if isinstance(items, str):
        _chatml(parts, "user", items)
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if isinstance(kind, str) and kind not in ("", "message"):
                continue
            role = item.get("role")
            if not isinstance(role, str) or not role:
                continue
            text = content_text(item.get("content"))
            if text is not None:
                _chatml(parts, role, text)
    elif items is not None:
        raise wrong_type("input", "a string or a list of input items", items)
    return "".join(parts)


def render_kthena(data: dict[str, Any]) -> str:
    """Kthena's ``ParsePrompt`` + ``GetPromptString``, whatever the path."""
    if "prompt" in data:
        prompt = data["prompt"]
        if not isinstance(prompt, str):
            raise wrong_type("prompt", "a string", prompt)
        return prompt
    if "messages" in data:
        messages = data["messages"]
        if not isinstance(messages, list):
            raise wrong_type("messages", "a list", messages)
        return _chat_messages(data, messages)
    if "input" in data:
        items = data["input"]
        if not isinstance(items, (str, list)):
            raise wrong_type("input", "a string or a list of input items", items)
        return _responses_input(data.get("instructions"), items)
    raise BadRequest(
        "the request has none of the fields 'prompt', 'messages' or 'input'",
        code="missing_field",
        param="prompt",
    )


def render_completions(data: dict[str, Any]) -> str:
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if prompt is None:
        raise missing("prompt")
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt) or all(
            isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt
        ):
            return ""  # token ids: nothing to match text against, routed unscored
    raise wrong_type("prompt", "a string, a list of strings or token ids", prompt)


def render_chat(data: dict[str, Any]) -> str:
    messages = data.get("messages")
    if messages is None:
        raise missing("messages")
    if not isinstance(messages, list):
        raise wrong_type("messages", "a list", messages)
    return _chat_messages(data, messages)


def render_responses(data: dict[str, Any]) -> str:
    items, instructions = data.get("input"), data.get("instructions")
    if items is None and not (isinstance(instructions, str) and instructions):
        raise missing("input")
    return _responses_input(instructions, items)
