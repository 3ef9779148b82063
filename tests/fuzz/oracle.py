"""What must hold for any request body, however malformed: shared by the hypothesis
properties (``tests/fuzz/test_fuzz.py``) and the atheris target (``fuzz_request.py``).

``check_body`` parses one body: it either routes (a model, a prompt that is valid UTF-8
and hashes) or fails with an ``ExtProcError`` whose status is 400 or 413 and whose body is
the OpenAI-style JSON error. Any other exception is a crash.
"""

from __future__ import annotations

import orjson

from extproc.errors import ExtProcError
from extproc.prefix.hashing import hash_prompt
from extproc.request.parse import Api, InferenceRequest, parse_request
from extproc.request.render import Rendering

PATHS = tuple(api.value for api in Api)
MAX_BODY_BYTES = 64 * 1024  # small, so the 413 path is reachable too

# The names the parser reads, so generated objects hit its branches.
FIELDS = (
    "model", "prompt", "messages", "role", "content", "type", "text", "system",
    "instructions", "input", "cache_salt", "stream", "input_text", "output_text", "message",
)  # fmt: skip


def check_body(
    path: str, body: bytes, rendering: Rendering = Rendering.EXTENDED
) -> InferenceRequest | ExtProcError:
    """Parse ``body`` for ``path``; assert the outcome is a route or a clean JSON error."""
    try:
        request = parse_request(
            path,
            body,
            {"x-session-id": "s"},
            session_header="x-session-id",
            max_body_bytes=MAX_BODY_BYTES,
            rendering=rendering,
        )
    except ExtProcError as exc:
        assert exc.http_status in (400, 413), exc.http_status
        error = orjson.loads(exc.to_body())["error"]
        assert error["type"] == "invalid_request_error" and error["code"], error
        assert isinstance(error["message"], str) and error["message"], error
        return exc
    assert isinstance(request.model, str) and request.model
    assert request.cache_salt is None or (
        isinstance(request.cache_salt, str) and request.cache_salt
    )
    assert isinstance(request.stream, bool)
    request.prompt.encode("utf-8")  # the hashing below needs it; a lone surrogate would fail
    hash_prompt(request.model, request.prompt, salt=request.cache_salt)
    return request
