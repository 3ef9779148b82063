"""extproc's side of the edge-body corpus (``testkit.edge_bodies``): each body is routed
with the model and prompt given here, or refused with the status and code given here.

What vLLM 0.32 does with the same bytes is measured live by
``e2e/real_vllm/test_edge_bodies.py``; the table in ``docs/reliability.md`` has both.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import orjson
import pytest

from extproc.errors import ExtProcError
from extproc.prefix.hashing import hash_prompt
from extproc.request.parse import InferenceRequest, parse_request
from extproc.request.render import Rendering
from testkit.edge_bodies import EdgeBody, edge_bodies

MODEL = "qwen3-tiny"
CORPUS = {e.name: e for e in edge_bodies(MODEL)}
FFFD = "\ufffd"


class Routed(NamedTuple):
    prompt: str
    model: str = MODEL
    salt: str | None = None
    stream: bool = False


class Refused(NamedTuple):
    status: int
    code: str


def user(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n"


SAY_HI = Routed("Say hi")
HI = Routed("hi")
BAD_JSON = Refused(400, "invalid_json")

EXPECTED: dict[str, Routed | Refused] = {
    "plain-completions": SAY_HI,
    "plain-chat": Routed(user("Say hi")),
    "plain-responses": Routed(user("Say hi")),
    "surrounding-whitespace": SAY_HI,
    "surrogate-pair-escape": Routed("smile \U0001f600"),
    # lone surrogates: U+FFFD, as Go's encoding/json (Kthena) decodes the escape
    "lone-surrogate-prompt": Routed(f"hi {FFFD} there"),
    "lone-low-surrogate-prompt": Routed(f"hi {FFFD} there"),
    "lone-surrogate-message": Routed(user(f"hi {FFFD} there")),
    "lone-surrogate-responses": Routed(user(f"hi {FFFD} there")),
    "lone-surrogate-role": Routed(f"<|im_start|>{FFFD}\nhi<|im_end|>\n"),
    "lone-surrogate-model": Routed("hi", model=f"qwen{FFFD}"),  # then 404: no pod serves it
    "lone-surrogate-cache-salt": Routed("Say hi", salt=f"tenant-{FFFD}"),
    "lone-surrogate-ignored-field": SAY_HI,
    "raw-0xff-prompt": Refused(400, "invalid_encoding"),
    "raw-0xff-message": Refused(400, "invalid_encoding"),
    "raw-cesu-surrogate": Routed(f"hi {FFFD} there"),
    "utf8-bom": SAY_HI,
    "utf16-body": SAY_HI,
    "1e400-temperature": SAY_HI,
    "minus-1e400-temperature": SAY_HI,
    "1e400-max-tokens": HI,
    "1e400-ignored-field": SAY_HI,
    "1e400-model": Refused(400, "invalid_type"),
    "nan-temperature": SAY_HI,
    "infinity-temperature": SAY_HI,
    "minus-infinity-ignored-field": SAY_HI,
    "nan-ignored-field": Routed(user("Say hi")),
    "huge-int-max-tokens": HI,
    "huge-int-seed": SAY_HI,
    "u64-max-seed": SAY_HI,
    "huge-int-ignored-field": SAY_HI,
    "int-5000-digits": BAD_JSON,
    "float-max-tokens": HI,
    "nesting-900": SAY_HI,
    "nesting-1025": BAD_JSON,
    "nesting-10001": BAD_JSON,
    "whitespace-model": Routed("hi", model="   "),  # then 404: no pod serves it
    "empty-model": Refused(400, "invalid_type"),
    "padded-model": Routed("hi", model=f" {MODEL} "),  # then 404
    "no-model": Refused(400, "missing_model"),
    "null-model": Refused(400, "missing_model"),
    "number-model": Refused(400, "invalid_type"),
    # duplicate keys: the last wins, in vLLM (Python's dict) as here
    "duplicate-model-last-served": HI,
    "duplicate-model-first-served": Routed("hi", model="no-such-model"),  # then 404
    "duplicate-prompt": Routed("second prompt"),
    "duplicate-messages": Routed(user("second")),
    "root-array": BAD_JSON,
    "root-string": BAD_JSON,
    "root-number": BAD_JSON,
    "root-null": BAD_JSON,
    "root-true": BAD_JSON,
    "empty-body": BAD_JSON,
    "whitespace-body": BAD_JSON,
    # parts: the text parts are read, the rest skipped (the pod refuses what it cannot use)
    "parts-text-only": Routed(user("Say\nhi")),
    "parts-text-and-image": Routed(user("What is this?")),
    "parts-text-and-unknown-type": Routed(user("hi")),
    "parts-text-without-type": Routed(user("hi")),
    "parts-input-text-in-chat": Routed(user("hi")),
    "escaped-nul": Routed("hi \x00 there"),
    "raw-tab-in-string": BAD_JSON,
    "raw-newline-in-string": BAD_JSON,
    "raw-nul-in-string": BAD_JSON,
    "raw-del-in-string": Routed("hi\x7fthere"),
    "long-single-token": Routed("x" * 100 * 1024),
    "long-single-token-ignored-field": SAY_HI,
    "trailing-garbage": BAD_JSON,
    "second-object": BAD_JSON,
    "trailing-comma": BAD_JSON,
    "single-quotes": BAD_JSON,
    "comment": BAD_JSON,
    # stream as pydantic's lax bool reads it (vLLM's ``stream: bool | None``)
    "stream-string-false": SAY_HI,
    "stream-string-true": Routed("Say hi", stream=True),
    "stream-string-maybe": Refused(400, "invalid_type"),
    "stream-int-0": SAY_HI,
    "stream-null": SAY_HI,
    "empty-cache-salt": Refused(400, "invalid_type"),
    "number-cache-salt": Refused(400, "invalid_type"),
}


def outcome(edge: EdgeBody, rendering: Rendering = Rendering.EXTENDED) -> Routed | Refused:
    try:
        req = parse_request(edge.api.value, edge.body, rendering=rendering)
    except ExtProcError as exc:
        error = orjson.loads(exc.to_body())["error"]  # a clean OpenAI-style error
        assert error["type"] == "invalid_request_error" and error["message"] == exc.message
        return Refused(exc.http_status, exc.code)
    assert_utf8_throughout(req)
    return Routed(req.prompt, req.model, req.cache_salt, req.stream)


def assert_utf8_throughout(req: InferenceRequest) -> None:
    """Every string a plugin can read (prompt, model, salt, the body) has a UTF-8 form,
    and the prompt hashes."""
    json.dumps(req.data, ensure_ascii=False).encode("utf-8")  # numbers of any size, NaN too
    (req.model + (req.cache_salt or "")).encode("utf-8")
    hash_prompt(req.model, req.prompt, salt=req.cache_salt)


def test_every_corpus_body_has_an_expected_outcome() -> None:
    assert sorted(EXPECTED) == sorted(CORPUS)


@pytest.mark.parametrize("name", list(CORPUS))
def test_edge_body(name: str) -> None:
    assert outcome(CORPUS[name]) == EXPECTED[name]


@pytest.mark.parametrize("name", list(CORPUS))
def test_edge_body_in_kthena_rendering(name: str) -> None:
    """The decoding is the same whichever rendering reads the prompt."""
    got = outcome(CORPUS[name], Rendering.KTHENA)
    expected = EXPECTED[name]
    assert type(got) is type(expected)
    if isinstance(got, Routed) and isinstance(expected, Routed):
        assert (got.model, got.salt, got.stream) == expected[1:]


def test_lone_surrogate_hashes_as_kthenas_replacement_character() -> None:
    """Kthena decodes ``\\ud800`` to U+FFFD and hashes its UTF-8 bytes (EF BF BD)."""
    req = parse_request("/v1/completions", CORPUS["lone-surrogate-prompt"].body)
    assert hash_prompt(MODEL, req.prompt) == hash_prompt(MODEL, "hi \ufffd there")


def test_surrogate_keys_collide_and_the_last_wins() -> None:
    body = b'{"model":"m","prompt":"x","\\ud800":1,"\\udc00":2,"k":["\\ud800",{"\\udc01":"a"}]}'
    data = parse_request("/v1/completions", body).data
    assert data is not None
    assert data[FFFD] == 2 and data["k"] == [FFFD, {FFFD: "a"}]


DEFAULTED = {"no-model", "null-model", "empty-model"}  # vLLM serves them with its model


@pytest.mark.parametrize("name", list(CORPUS))
def test_only_bodies_naming_no_model_take_the_default(name: str) -> None:
    """Given the routing layer's default, the bodies vLLM serves with its served model are
    routed as it, and the default is asked for no other body."""
    asked: list[str] = []

    def default_model() -> str:
        asked.append(name)
        return MODEL

    edge = CORPUS[name]
    try:
        req = parse_request(edge.api.value, edge.body, default_model=default_model)
    except ExtProcError as exc:
        assert name not in DEFAULTED and EXPECTED[name] == Refused(exc.http_status, exc.code)
    else:
        expected = HI if name in DEFAULTED else EXPECTED[name]
        assert (req.prompt, req.model) == expected[:2]
    assert asked == ([name] if name in DEFAULTED else [])
