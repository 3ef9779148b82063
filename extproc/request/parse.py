"""Request body -> ``InferenceRequest``: the model, the rendered prompt and routing keys.

The path selects the API; the body must be a JSON object with a ``model``; the prompt is
rendered by ``request.render`` as Kthena renders it (``Rendering`` chooses whether the
path or Kthena's fixed field order says where the prompt is). Anything that cannot be routed
raises ``BadRequest`` (or ``BodyTooLarge``) with a message naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import orjson

from extproc.errors import BadRequest, BodyTooLarge
from extproc.request.render import (
    Rendering,
    json_type,
    render_chat,
    render_completions,
    render_kthena,
    render_responses,
)


class Api(str, Enum):
    COMPLETIONS = "/v1/completions"
    CHAT_COMPLETIONS = "/v1/chat/completions"
    RESPONSES = "/v1/responses"


API_BY_PATH: dict[str, Api] = {api.value: api for api in Api}

# The one body limit: extproc's --max-body-bytes, Envoy's buffer (extproc envoy-config)
# and the simulated pods'; 8 MB prompts with room to spare.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """What the scheduler needs to know about one request."""

    api: Api
    model: str
    prompt: str  # rendered text; "" when there is nothing to match on
    cache_salt: str | None = None
    stream: bool = False
    session_key: str | None = None
    # The parsed body, for plugins that render the prompt themselves (precise-prefix-cache).
    data: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)


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
    rendering: Rendering = Rendering.EXTENDED,
) -> InferenceRequest:
    """Parse and render one OpenAI-style request.

    Args:
        path: the request path, which selects the API.
        body: the raw JSON body.
        headers: request headers with lower-case names (only ``session_header`` is read).
        session_header: the header carrying the session key, if sessions are used.
        max_body_bytes: larger bodies are refused with 413.
        rendering: where the prompt is read from (``request.render.Rendering``).

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
    prompt = render_kthena(data) if rendering is Rendering.KTHENA else _RENDERERS[api](data)
    _check_encodable(prompt)
    session_key = None
    if session_header and headers:
        session_key = headers.get(session_header) or None
    return InferenceRequest(api, model, prompt, salt, stream, session_key, data)


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
            f"the request body must be a JSON object, got {json_type(data)}", code="invalid_json"
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


_RENDERERS = {
    Api.COMPLETIONS: render_completions,
    Api.CHAT_COMPLETIONS: render_chat,
    Api.RESPONSES: render_responses,
}
