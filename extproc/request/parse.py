"""Request body -> ``InferenceRequest``: the model, the rendered prompt and routing keys.

The path selects the API; the body must be a JSON object with a ``model`` (or the caller's
default, where vLLM defaults it); the prompt is
rendered by ``request.render`` as Kthena renders it (``Rendering`` chooses whether the
path or Kthena's fixed field order says where the prompt is). Anything that cannot be routed
raises ``BadRequest`` (or ``BodyTooLarge``) with a message naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
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
    default_model: Callable[[], str] | None = None,
) -> InferenceRequest:
    """Parse and render one OpenAI-style request.

    Args:
        path: the request path, which selects the API.
        body: the raw JSON body.
        headers: request headers with lower-case names (only ``session_header`` is read).
        session_header: the header carrying the session key, if sessions are used.
        max_body_bytes: larger bodies are refused with 413.
        rendering: where the prompt is read from (``request.render.Rendering``).
        default_model: called only for a body naming no model (absent, null or ``""``,
            which vLLM serves with its served model): the model to route it as (it may
            raise, e.g. when the pods serve several). Without it such a body is refused.

    Raises:
        BadRequest: the body cannot be routed as sent; the message says why.
    """
    api = api_for_path(path)
    if len(body) > max_body_bytes:
        raise BodyTooLarge(
            f"request body is {len(body)} bytes, over the limit of {max_body_bytes} bytes"
        )
    data = load_body(body)
    model = data.get("model")
    if not model or not isinstance(model, str):
        model = _model_or_default(model, default_model)
    salt = data.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest(
            "'cache_salt' must be a non-empty string", code="invalid_type", param="cache_salt"
        )
    stream = stream_flag(data.get("stream"))
    prompt = render_kthena(data) if rendering is Rendering.KTHENA else _RENDERERS[api](data)
    session_key = None
    if session_header and headers:
        session_key = headers.get(session_header) or None
    return InferenceRequest(api, model, prompt, salt, stream, session_key, data)


def _model_or_default(model: object, default_model: Callable[[], str] | None) -> str:
    """A body's ``model`` that is no non-empty string: its default where vLLM would
    default it (absent, null or ``""``, and ``default_model`` given), else refused."""
    if (model is None or model == "") and default_model is not None:
        return default_model()
    if model is None:
        raise BadRequest("the request has no 'model' field", code="missing_model", param="model")
    raise BadRequest("'model' must be a non-empty string", code="invalid_type", param="model")


def load_body(body: bytes, *, keep_surrogates: bool = False) -> dict[str, Any]:
    """The body's object: orjson's decoding, or vLLM's where orjson refuses the body.

    orjson is strict JSON: it refuses what vLLM's server takes (``_load_json_as_vllm``), and
    it never yields a lone surrogate, so its strings are all UTF-8 (hashable as they are).
    ``keep_surrogates``: leave the lone surrogates vLLM's decoding keeps (the simulated
    pods, which refuse them where vLLM does), not U+FFFD.

    Raises:
        BadRequest: empty, not JSON as vLLM reads it, or not an object.
    """
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = _load_json_as_vllm(body, keep_surrogates)
    if not isinstance(data, dict):
        raise BadRequest(
            f"the request body must be a JSON object, got {json_type(data)}", code="invalid_json"
        )
    return data


def _load_json_as_vllm(body: bytes, keep_surrogates: bool = False) -> Any:
    """``body`` decoded as vLLM's server decodes it, its lone surrogates made U+FFFD
    unless ``keep_surrogates``.

    vLLM (FastAPI, Starlette's ``Request.json``) calls ``json.loads`` on the bytes with its
    default options: a UTF-8 BOM and UTF-16/32 are decoded, ``NaN``, ``Infinity`` and
    numbers past a double (``1e400``: inf) are taken, integers keep every digit, escapes
    of lone surrogates are kept; invalid UTF-8, nesting past the recursion limit or an
    integer over 4,300 digits are refused (vLLM: 400). Each surrogate left in a string
    (keys too) becomes U+FFFD, as Go's ``encoding/json`` (Kthena) decodes a lone surrogate
    escape: the prompt, model and salt hash as Kthena hashes them, and nothing downstream
    meets a string without a UTF-8 form.
    """
    try:
        data = json.loads(body)
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding"
        ) from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, or an integer over Python's digit limit
        raise BadRequest(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    return data if keep_surrogates else _replace_surrogates(data)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _safe_text(text: str) -> str:
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def _replace_surrogates(data: Any) -> Any:
    """``data`` with every surrogate in its strings replaced by U+FFFD (in place: the
    containers are the decoder's own), walked without recursion (it may be ~1,000 deep)."""
    if isinstance(data, str):
        return _safe_text(data)
    pending = [data]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if not all(key.isascii() for key in node):
                fixed = {_safe_text(key): value for key, value in node.items()}
                node.clear()
                node.update(fixed)  # colliding keys: the last wins, as in a Go map
            items: Any = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        for key, value in list(items):
            if isinstance(value, str):
                node[key] = _safe_text(value)
            elif isinstance(value, (dict, list)):
                pending.append(value)
    return data


# What pydantic's lax ``bool`` (vLLM's ``stream: bool | None``) takes, lower-cased.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def stream_flag(value: object) -> bool:
    """``stream`` read as vLLM reads it: a boolean, null (false), 0 or 1, or a string
    pydantic takes for a boolean (``"true"``, ``"no"``...); anything else is refused."""
    if value is None or value is False or value is True:
        return bool(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.lower()
        if lowered in _TRUE or lowered in _FALSE:
            return lowered in _TRUE
    raise BadRequest("'stream' must be a boolean", code="invalid_type", param="stream")


_RENDERERS = {
    Api.COMPLETIONS: render_completions,
    Api.CHAT_COMPLETIONS: render_chat,
    Api.RESPONSES: render_responses,
}
