"""The prompt text a request is matched on, rendered as Kthena renders it.

The prompt is rendered exactly as Kthena's prefix-cache plugin renders it, so that two
requests share a prefix here exactly when they would there:

* ``/v1/completions``: ``prompt`` as is (a list of strings is joined with newlines; a
  prompt of token ids has no text and is routed unscored).
* ``/v1/chat/completions``: each message in ChatML,
  ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, a top-level ``system`` field first as a
  system message. List content keeps only ``text``/``input_text``/``output_text`` parts,
  joined with a newline; other parts (images, audio, ...) are skipped.
* ``/v1/responses``: ``instructions`` as a ``developer`` message, then ``input``: a string
  is a ``user`` message; list items of type ``message`` (or untyped items with a role,
  as the OpenAI client sends them) keep their role, other items are skipped.

Anything that cannot be rendered raises ``BadRequest`` with a message naming the field.
"""

from __future__ import annotations

from typing import Any

from extproc.errors import BadRequest

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


def wrong_type(param: str, expected: str, value: object) -> BadRequest:
    return BadRequest(
        f"'{param}' must be {expected}, got {json_type(value)}", code="invalid_type", param=param
    )


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


def _chatml(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def render_completions(data: dict[str, Any]) -> str:
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if prompt is None:
        raise BadRequest("the request has no 'prompt' field", code="missing_field", param="prompt")
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt) or all(
            isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt
        ):
            return ""  # token ids: nothing to match text against, routed unscored
    raise wrong_type("prompt", "a string, a list of strings or token ids", prompt)


def _render_content(content: object, where: str) -> str:
    """A message's content: a string, null, or a list of parts of which text is kept."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise wrong_type(f"{where}.content", "a string, a list of content parts or null", content)
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise wrong_type(f"{where}.content[{j}]", "an object", part)
        kind = part.get("type")
        if not isinstance(kind, str):  # (an object or a list would not even hash)
            raise wrong_type(f"{where}.content[{j}].type", "a string", kind)
        if kind not in TEXT_PART_TYPES:
            continue
        text = part.get("text")
        if not isinstance(text, str):
            raise wrong_type(f"{where}.content[{j}].text", "a string", text)
        texts.append(text)
    return "\n".join(texts)


def _render_message(message: object, where: str) -> str:
    if not isinstance(message, dict):
        raise wrong_type(where, "an object", message)
    role = message.get("role")
    if not isinstance(role, str):
        raise wrong_type(f"{where}.role", "a string", role)
    return _chatml(role, _render_content(message.get("content"), where))


def render_chat(data: dict[str, Any]) -> str:
    messages = data.get("messages")
    if messages is None:
        raise BadRequest(
            "the request has no 'messages' field", code="missing_field", param="messages"
        )
    if not isinstance(messages, list):
        raise wrong_type("messages", "a list", messages)
    parts: list[str] = []
    system = data.get("system")
    if system is not None:
        parts.append(_chatml("system", _render_content(system, "system")))
    parts.extend(_render_message(m, f"messages[{i}]") for i, m in enumerate(messages))
    return "".join(parts)


def render_responses(data: dict[str, Any]) -> str:
    parts: list[str] = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise wrong_type("instructions", "a string", instructions)
        parts.append(_chatml("developer", instructions))
    items = data.get("input")
    if isinstance(items, str):
        parts.append(_chatml("user", items))
    elif isinstance(items, list):
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise wrong_type(f"input[{i}]", "an object", item)
            kind = item.get("type")
            if kind == "message" or (kind is None and "role" in item):
                parts.append(_render_message(item, f"input[{i}]"))
    elif items is not None:
        raise wrong_type("input", "a string or a list of input items", items)
    elif instructions is None:
        raise BadRequest("the request has no 'input' field", code="missing_field", param="input")
    return "".join(parts)
