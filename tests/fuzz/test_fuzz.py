"""Fuzzing the body parser and the prompt renderer: hypothesis properties, a bounded
atheris run, and the inputs fuzzing found replayed as regressions.

Whatever the body, ``oracle.check_body`` must see a route or a clean 400/413 JSON
error, never another exception (which would be a 500 through Envoy).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.request.parse import Api, InferenceRequest, parse_request
from extproc.request.render import Rendering
from tests.fuzz.oracle import FIELDS, PATHS, check_body

FUZZ_DIR = Path(__file__).parent

paths = st.sampled_from(PATHS)
keys = st.one_of(st.sampled_from(FIELDS), st.text(max_size=6))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
    st.sampled_from(FIELDS),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=30,
)
requests = st.fixed_dictionaries(
    {}, optional={"model": st.one_of(st.just("m"), json_values)}
).flatmap(lambda base: st.dictionaries(keys, json_values, max_size=4).map(lambda d: {**d, **base}))


@settings(max_examples=400, deadline=None)
@given(paths, st.binary(max_size=300))
def test_any_bytes_route_or_get_a_json_error(path: str, body: bytes) -> None:
    check_body(path, body)


def encode(value: object, ascii_only: bool) -> bytes:
    """JSON as a client may send it: escaped, or raw UTF-8 (lone surrogates kept as the
    invalid bytes a careless client writes); ints of any size."""
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paths, requests, st.booleans(), st.sampled_from(list(Rendering)))
def test_any_json_request_routes_or_gets_a_json_error(
    path: str, request: object, ascii_only: bool, rendering: Rendering
) -> None:
    check_body(path, encode(request, ascii_only), rendering)


@settings(max_examples=200, deadline=None)
@given(paths, json_values, st.integers(0, 40))
def test_truncated_json_is_a_400(path: str, value: object, cut: int) -> None:
    body = encode({"model": "m", "prompt": value}, True)
    outcome = check_body(path, body[: max(0, len(body) - 1 - cut)])
    assert not isinstance(outcome, InferenceRequest)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.dictionaries(st.sampled_from(["type", "text", "role"]), json_values), max_size=4),
    st.sampled_from(["messages", "input", "system"]),
)
def test_any_content_parts_route_or_get_a_json_error(parts: list[object], field: str) -> None:
    """Parts of any shape inside a message: how atheris found the object-typed part."""
    message = {"role": "user", "content": parts}
    value: object = parts if field == "system" else [message]
    path = Api.RESPONSES.value if field == "input" else Api.CHAT_COMPLETIONS.value
    check_body(path, encode({"model": "m", "messages": [], field: value}, True))


messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "wizard"]),
            "content": st.one_of(
                st.text(max_size=40),
                st.none(),
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.sampled_from(["text", "input_text", "image_url"]),
                            "text": st.text(max_size=20),
                        }
                    ),
                    max_size=3,
                ),
            ),
        }
    ),
    max_size=6,
)


@settings(deadline=None)  # a per-example time limit fails on a loaded machine, not on a bug
@given(messages, st.integers(0, 6), st.sampled_from([Api.CHAT_COMPLETIONS, Api.RESPONSES]))
def test_a_longer_conversation_renders_to_a_longer_prompt_with_the_same_start(
    turns: list[dict[str, object]], keep: int, api: Api
) -> None:
    """What prefix affinity rests on: a conversation's next turn extends its prompt."""
    field = "messages" if api is Api.CHAT_COMPLETIONS else "input"

    def prompt(items: list[dict[str, object]]) -> str:
        body = orjson.dumps({"model": "m", field: items, "instructions": "be brief"})
        return parse_request(api.value, body).prompt

    assert prompt(turns).startswith(prompt(turns[:keep]))


# Inputs worth keeping: found by fuzzing, or the edges the fuzzers are told about.
REGRESSIONS = {
    # decoded as vLLM decodes them (issue 33, tests/request/test_edge_bodies.py)
    "bom": (Api.COMPLETIONS, b'\xef\xbb\xbf{"model":"m","prompt":"x"}', None),
    "int-over-64-bits-model": (Api.COMPLETIONS, b'{"model":1e400,"prompt":"x"}', "invalid_type"),
    "big-int-token-ids": (
        Api.COMPLETIONS,
        b'{"model":"m","prompt":[18446744073709551616]}',
        "invalid_type",
    ),
    "nested-bool-token-ids": (Api.COMPLETIONS, b'{"model":"m","prompt":[[true,false]]}', None),
    "nan": (Api.COMPLETIONS, b'{"model":"m","prompt":NaN}', "invalid_type"),
    "lone-surrogate-in-role": (
        Api.CHAT_COMPLETIONS,
        b'{"model":"m","messages":[{"role":"\\udc00","content":"x"}]}',
        None,  # the role hashed as U+FFFD
    ),
    "depth-1025": (
        Api.COMPLETIONS,
        b'{"model":"m","prompt":' + b"[" * 1025 + b"]" * 1025 + b"}",
        "invalid_json",
    ),
    "null-model": (Api.COMPLETIONS, b'{"model":null,"prompt":"x"}', "missing_model"),
    "duplicate-keys-last-wins": (Api.COMPLETIONS, b'{"model":5,"model":"m","prompt":"x"}', None),
    "stream-null-is-false": (Api.COMPLETIONS, b'{"model":"m","prompt":"x","stream":null}', None),
    "only-instructions": (Api.RESPONSES, b'{"model":"m","instructions":"i"}', None),
    # atheris: a part's type that is an object was looked up in a set (TypeError, a 500);
    # now accepted as Kthena accepts a part whose type is not a string (it has no text)
    "part-type-object": (
        Api.CHAT_COMPLETIONS,
        b'{"model":"m","messages":[{"role":"user","content":[{"type":{"url":"x"}}]}]}',
        None,
    ),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regressions(name: str) -> None:
    api, body, code = REGRESSIONS[name]
    outcome = check_body(api.value, body)
    if code is None:
        assert isinstance(outcome, InferenceRequest)
    else:
        assert not isinstance(outcome, InferenceRequest) and outcome.code == code


@pytest.mark.parametrize(
    "crash", sorted((FUZZ_DIR / "regressions").glob("*")), ids=lambda p: p.name
)
def test_atheris_crash_inputs_stay_fixed(crash: Path) -> None:
    from tests.fuzz.fuzz_request import test_one_input

    test_one_input(crash.read_bytes())  # the atheris target's own decoding, without atheris


# A count, not a time limit: every run does them all (about 6 s on an idle core; the
# subprocess timeout leaves a loaded 2-core runner ten times that and more).
ATHERIS_RUNS = 300_000
ATHERIS_TIMEOUT_S = 240


def test_atheris_finds_no_crash_in_a_bounded_run(tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    shutil.copytree(FUZZ_DIR / "seeds", corpus)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.fuzz.fuzz_request",
            f"-runs={ATHERIS_RUNS}",
            "-max_len=4096",
            f"-artifact_prefix={tmp_path}/",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=ATHERIS_TIMEOUT_S,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    crashes = sorted(p.name for p in tmp_path.glob("crash-*"))
    assert result.returncode == 0 and not crashes, (crashes, result.stderr[-3000:])
    done = re.search(r"Done (\d+) runs", result.stderr)
    assert done is not None and int(done.group(1)) == ATHERIS_RUNS, result.stderr[-3000:]
