"""Request body -> ``InferenceRequest``: the model, the rendered prompt and routing keys.

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

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson

from extproc.errors import BadRequest, BodyTooLarge


class Api(str, Enum):
    COMPLETIONS = "/v1/completions"
    CHAT_COMPLETIONS = "/v1/chat/completions"
    RESPONSES = "/v1/responses"


API_BY_PATH: dict[str, Api] = {api.value: api for api in Api}

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # Envoy's config lets 8 MB bodies through


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """What the scheduler needs to know about one request."""

    api: Api
    model: str
    prompt: str  # rendered text; "" when there is nothing to match on
    cache_salt: str | None = None
    stream: bool = False
    session_key: str | None = None


def api_for_path(path: str) -> Api:
    """Map an HTTP path (query string allowed) to the API it calls."""
    api = API_BY_PATH.get(path.split("?", 1)[0].rstrip("/"))
    if api is None:
        raise BadRequest(
            f"unsupported endpoint {path!r}: extproc routes " + ", ".join(a.value for a in Api),
            code="unsupported_endpoint",
        )
    return api


def parse_request(
    path: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    *,
    session_header: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> InferenceRequest:
    """Parse and render one OpenAI-style request.

    Args:
        path: the request path, which selects the API.
        body: the raw JSON body.
        headers: request headers with lower-case names (only ``session_header`` is read).
        session_header: the header carrying the session key, if sessions are used.
        max_body_bytes: larger bodies are refused with 413.

    Raises:
        BadRequest: the body cannot be routed as sent; the message says why.
    """
    api = api_for_path(path)
    if len(body) > max_body_bytes:
        raise BodyTooLarge(
            f"request body is {len(body)} bytes, over the limit of {max_body_bytes} bytes"
        )
    data = _load_json(body)
    model = data.get("model")
    if model is None:
        raise BadRequest("the request has no 'model' field", code="missing_model", param="model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", code="invalid_type", param="model")
    salt = data.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest(
            "'cache_salt' must be a non-empty string", code="invalid_type", param="cache_salt"
        )
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", code="invalid_type", param="stream")
    prompt = _RENDERERS[api](data)
    _check_encodable(prompt)
    session_key = None
    if session_header and headers:
        session_key = headers.get(session_header) or None
    return InferenceRequest(api, model, prompt, salt, stream, session_key)


def _load_json(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as uexc:
            raise BadRequest(
                f"the request body is not valid UTF-8 (byte {uexc.start})",
                code="invalid_encoding",
            ) from None
        raise BadRequest(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise BadRequest(
            f"the request body must be a JSON object, got {_json_type(data)}", code="invalid_json"
        )
    return data


def _check_encodable(prompt: str) -> None:
    """JSON escapes can smuggle lone surrogates, which have no UTF-8 form."""
    if prompt.isascii():  # a flag CPython keeps on every str: no scan
        return
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(
            "the prompt contains text that is not valid UTF-8 (a lone surrogate escape)",
            code="invalid_encoding",
        ) from None


def _wrong_type(param: str, expected: str, value: object) -> BadRequest:
    return BadRequest(
        f"'{param}' must be {expected}, got {_json_type(value)}", code="invalid_type", param=param
    )


def _json_type(value: object) -> str:
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


def _render_completions(data: dict[str, Any]) -> str:
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
    raise _wrong_type("prompt", "a string, a list of strings or token ids", prompt)


def _render_content(content: object, where: str) -> str:
    """A message's content: a string, null, or a list of parts of which text is kept."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise _wrong_type(f"{where}.content", "a string, a list of content parts or null", content)
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _wrong_type(f"{where}.content[{j}]", "an object", part)
        kind = part.get("type")
        if not isinstance(kind, str):  # (an object or a list would not even hash)
            raise _wrong_type(f"{where}.content[{j}].type", "a string", kind)
        if kind not in TEXT_PART_TYPES:
            continue
        text = part.get("text")
        if not isinstance(text, str):
            raise _wrong_type(f"{where}.content[{j}].text", "a string", text)
        texts.append(text)
    return "\n".join(texts)


def _render_message(message: object, where: str) -> str:
    if not isinstance(message, dict):
        raise _wrong_type(where, "an object", message)
    role = message.get("role")
    if not isinstance(role, str):
        raise _wrong_type(f"{where}.role", "a string", role)
    return _chatml(role, _render_content(message.get("content"), where))


def _render_chat(data: dict[str, Any]) -> str:
    messages = data.get("messages")
    if messages is None:
        raise BadRequest(
            "the request has no 'messages' field", code="missing_field", param="messages"
        )
    if not isinstance(messages, list):
        raise _wrong_type("messages", "a list", messages)
    parts: list[str] = []
    system = data.get("system")
    if system is not None:
        parts.append(_chatml("system", _render_content(system, "system")))
    parts.extend(_render_message(m, f"messages[{i}]") for i, m in enumerate(messages))
    return "".join(parts)


def _render_responses(data: dict[str, Any]) -> str:
    parts: list[str] = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _wrong_type("instructions", "a string", instructions)
        parts.append(_chatml("developer", instructions))
    items = data.get("input")
    if isinstance(items, str):
        parts.append(_chatml("user", items))
    elif isinstance(items, list):
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise _wrong_type(f"input[{i}]", "an object", item)
            kind = item.get("type")
            if kind == "message" or (kind is None and "role" in item):
                parts.append(_render_message(item, f"input[{i}]"))
    elif items is not None:
        raise _wrong_type("input", "a string or a list of input items", items)
    elif instructions is None:
        raise BadRequest("the request has no 'input' field", code="missing_field", param="input")
    return "".join(parts)


_RENDERERS = {
    Api.COMPLETIONS: _render_completions,
    Api.CHAT_COMPLETIONS: _render_chat,
    Api.RESPONSES: _render_responses,
}
