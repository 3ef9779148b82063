"""Request bodies at the edges of JSON decoding (issue 33: accept what the engine accepts).

Each entry is raw bytes, as a client may send them, for one endpoint, with what it probes.
``tests/request/test_edge_bodies.py`` pins extproc's outcome for each (routed with which
model and prompt, or refused with which status and code);
``e2e/real_vllm/test_edge_bodies.py`` sends each straight to a real vLLM pod and through
Envoy + extproc, and checks that extproc routes every body vLLM serves and refuses only
bodies vLLM refuses too, with the same status class; ``tests/sim/test_edge_bodies.py``
checks the simulated pods answer each with vLLM's status class. ``VLLM_STATUS`` is what
vLLM 0.32 answered (the real-vLLM test checks it still does); ``docs/reliability.md`` has
the table of both outcomes and Kthena's.

The bodies ask for one generated token (``max_tokens``) unless that field is the probe.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from extproc.request.parse import Api

C, CHAT, R = Api.COMPLETIONS, Api.CHAT_COMPLETIONS, Api.RESPONSES

LONG_TOKEN_BYTES = 100 * 1024  # one "word" with no space or punctuation
KTHENA_MAX_DEPTH = 10_000  # Go encoding/json's maxNestingDepth
ORJSON_MAX_DEPTH = 1024  # orjson's recursion limit (arrays and objects)


@dataclass(frozen=True, slots=True)
class EdgeBody:
    """One body: its name (a test id), the endpoint, the bytes, and what it probes."""

    name: str
    api: Api
    body: bytes
    probes: str


def nested(depth: int) -> bytes:
    """``depth`` arrays, each inside the last: ``[[...]]``."""
    return b"[" * depth + b"]" * depth


def edge_bodies(model: str) -> tuple[EdgeBody, ...]:
    """The corpus for a pod serving ``model``."""
    m = json.dumps(model).encode()

    def completions(fields: bytes, prompt: bytes = b'"Say hi"') -> bytes:
        return b'{"model":%s,"prompt":%s,"max_tokens":1%s}' % (m, prompt, fields)

    def chat(content: bytes, fields: bytes = b"") -> bytes:
        message = b'{"role":"user","content":%s}' % content
        return b'{"model":%s,"messages":[%s],"max_tokens":1%s}' % (m, message, fields)

    def responses(items: bytes) -> bytes:
        return b'{"model":%s,"input":%s,"max_output_tokens":16}' % (m, items)

    long_token = b'"' + b"x" * LONG_TOKEN_BYTES + b'"'
    return (
        # Controls: what every engine and router accepts.
        EdgeBody("plain-completions", C, completions(b""), "control: an ordinary body"),
        EdgeBody("plain-chat", CHAT, chat(b'"Say hi"'), "control: an ordinary body"),
        EdgeBody("plain-responses", R, responses(b'"Say hi"'), "control: an ordinary body"),
        EdgeBody(
            "surrounding-whitespace",
            C,
            b" \r\n\t" + completions(b"") + b" \r\n\t",
            "whitespace around the object (JSON allows it)",
        ),
        EdgeBody(
            "surrogate-pair-escape",
            C,
            completions(b"", b'"smile \\ud83d\\ude00"'),
            "a valid surrogate pair, escaped (one character, U+1F600)",
        ),
        # Unicode that is not UTF-8.
        EdgeBody(
            "lone-surrogate-prompt",
            C,
            completions(b"", b'"hi \\ud800 there"'),
            "a lone high surrogate escape in the prompt (no UTF-8 form)",
        ),
        EdgeBody(
            "lone-low-surrogate-prompt",
            C,
            completions(b"", b'"hi \\udc00 there"'),
            "a lone low surrogate escape in the prompt",
        ),
        EdgeBody(
            "lone-surrogate-message",
            CHAT,
            chat(b'"hi \\ud800 there"'),
            "a lone surrogate escape in a message's content",
        ),
        EdgeBody(
            "lone-surrogate-responses",
            R,
            responses(b'"hi \\ud800 there"'),
            "a lone surrogate escape in a responses input",
        ),
        EdgeBody(
            "lone-surrogate-role",
            CHAT,
            b'{"model":%s,"messages":[{"role":"\\udc00","content":"hi"}],"max_tokens":1}' % m,
            "a lone surrogate escape as a message's role",
        ),
        EdgeBody(
            "lone-surrogate-model",
            C,
            b'{"model":"qwen\\ud800","prompt":"hi","max_tokens":1}',
            "a lone surrogate escape in the model name",
        ),
        EdgeBody(
            "lone-surrogate-cache-salt",
            C,
            completions(b',"cache_salt":"tenant-\\ud800"'),
            "a lone surrogate escape in cache_salt",
        ),
        EdgeBody(
            "lone-surrogate-ignored-field",
            C,
            completions(b',"user":"\\ud800"'),
            "a lone surrogate escape in a field routing ignores (user)",
        ),
        EdgeBody(
            "raw-0xff-prompt",
            C,
            completions(b"", b'"hi \xff there"'),
            "a raw 0xFF byte (never valid UTF-8) inside the prompt",
        ),
        EdgeBody(
            "raw-0xff-message",
            CHAT,
            chat(b'"hi \xff there"'),
            "a raw 0xFF byte inside a message's content",
        ),
        EdgeBody(
            "raw-cesu-surrogate",
            C,
            completions(b"", b'"hi \xed\xa0\x80 there"'),
            "a surrogate written as raw bytes (ED A0 80, CESU-8), invalid UTF-8",
        ),
        EdgeBody(
            "utf8-bom",
            C,
            b"\xef\xbb\xbf" + completions(b""),
            "a UTF-8 byte order mark before the object",
        ),
        EdgeBody(
            "utf16-body",
            C,
            completions(b"").decode().encode("utf-16"),
            "the whole body in UTF-16 with its BOM",
        ),
        # Numbers beyond a double or a 64-bit integer.
        EdgeBody(
            "1e400-temperature",
            C,
            completions(b',"temperature":1e400'),
            "a number out of double range in a used float field",
        ),
        EdgeBody(
            "minus-1e400-temperature",
            C,
            completions(b',"temperature":-1e400'),
            "minus that, in a used float field",
        ),
        EdgeBody(
            "1e400-max-tokens",
            C,
            b'{"model":%s,"prompt":"hi","max_tokens":1e400}' % m,
            "a number out of double range in an integer field",
        ),
        EdgeBody(
            "1e400-ignored-field",
            C,
            completions(b',"x_extra":1e400'),
            "a number out of double range in a field nobody reads",
        ),
        EdgeBody(
            "1e400-model",
            C,
            b'{"model":1e400,"prompt":"hi","max_tokens":1}',
            "a number out of double range as the model",
        ),
        EdgeBody(
            "nan-temperature",
            C,
            completions(b',"temperature":NaN'),
            "a NaN literal (not JSON) in a used float field",
        ),
        EdgeBody(
            "infinity-temperature",
            C,
            completions(b',"temperature":Infinity'),
            "an Infinity literal in a used float field",
        ),
        EdgeBody(
            "minus-infinity-ignored-field",
            C,
            completions(b',"x_extra":-Infinity'),
            "a -Infinity literal in a field nobody reads",
        ),
        EdgeBody(
            "nan-ignored-field",
            CHAT,
            chat(b'"Say hi"', b',"x_extra":NaN'),
            "a NaN literal in a field nobody reads",
        ),
        EdgeBody(
            "huge-int-max-tokens",
            C,
            b'{"model":%s,"prompt":"hi","max_tokens":%s}' % (m, b"1" + b"0" * 39),
            "a 40-digit integer as max_tokens",
        ),
        EdgeBody(
            "huge-int-seed",
            C,
            completions(b',"seed":%s' % (b"9" * 40)),
            "a 40-digit integer as the seed",
        ),
        EdgeBody(
            "u64-max-seed",
            C,
            completions(b',"seed":18446744073709551615'),
            "the largest 64-bit unsigned integer as the seed",
        ),
        EdgeBody(
            "huge-int-ignored-field",
            C,
            completions(b',"x_extra":%s' % (b"1" + b"0" * 39)),
            "a 40-digit integer in a field nobody reads",
        ),
        EdgeBody(
            "int-5000-digits",
            C,
            completions(b',"x_extra":%s' % (b"7" * 5000)),
            "an integer longer than Python's int/str limit (4,300 digits)",
        ),
        EdgeBody(
            "float-max-tokens",
            C,
            b'{"model":%s,"prompt":"hi","max_tokens":1.0}' % m,
            "an integral float where an integer is expected",
        ),
        # Depth.
        EdgeBody(
            "nesting-900",
            C,
            completions(b',"x_extra":%s' % nested(900)),
            "arrays nested 900 deep in an extra field",
        ),
        EdgeBody(
            "nesting-1025",
            C,
            completions(b',"x_extra":%s' % nested(ORJSON_MAX_DEPTH + 1)),
            "one level deeper than orjson's limit, in an extra field",
        ),
        EdgeBody(
            "nesting-10001",
            C,
            completions(b',"x_extra":%s' % nested(KTHENA_MAX_DEPTH + 1)),
            "one level deeper than Go's encoding/json allows",
        ),
        # The model.
        EdgeBody(
            "whitespace-model",
            C,
            b'{"model":"   ","prompt":"hi","max_tokens":1}',
            "a whitespace-only model",
        ),
        EdgeBody(
            "empty-model",
            C,
            b'{"model":"","prompt":"hi","max_tokens":1}',
            "an empty model",
        ),
        EdgeBody(
            "padded-model",
            C,
            b'{"model":" %s ","prompt":"hi","max_tokens":1}' % model.encode(),
            "the served model with spaces around it",
        ),
        EdgeBody(
            "no-model",
            C,
            b'{"prompt":"hi","max_tokens":1}',
            "no model field (vLLM may default to its served model)",
        ),
        EdgeBody(
            "null-model",
            C,
            b'{"model":null,"prompt":"hi","max_tokens":1}',
            "a null model",
        ),
        EdgeBody(
            "number-model",
            C,
            b'{"model":7,"prompt":"hi","max_tokens":1}',
            "a number as the model",
        ),
        # Duplicate keys: which one wins.
        EdgeBody(
            "duplicate-model-last-served",
            C,
            b'{"model":"no-such-model","model":%s,"prompt":"hi","max_tokens":1}' % m,
            "model twice, an unknown one first and the served one last",
        ),
        EdgeBody(
            "duplicate-model-first-served",
            C,
            b'{"model":%s,"model":"no-such-model","prompt":"hi","max_tokens":1}' % m,
            "model twice, the served one first and an unknown one last",
        ),
        EdgeBody(
            "duplicate-prompt",
            C,
            b'{"model":%s,"prompt":"first prompt","prompt":"second prompt","max_tokens":1}' % m,
            "prompt twice: the hash must be of the one vLLM uses",
        ),
        EdgeBody(
            "duplicate-messages",
            CHAT,
            b'{"model":%s,"messages":[{"role":"user","content":"first"}],'
            b'"messages":[{"role":"user","content":"second"}],"max_tokens":1}' % m,
            "messages twice",
        ),
        # Roots that are not objects.
        EdgeBody("root-array", C, b"[" + completions(b"") + b"]", "an array around the object"),
        EdgeBody("root-string", C, b'"hello"', "a string as the whole body"),
        EdgeBody("root-number", C, b"42", "a number as the whole body"),
        EdgeBody("root-null", C, b"null", "null as the whole body"),
        EdgeBody("root-true", C, b"true", "true as the whole body"),
        EdgeBody("empty-body", C, b"", "no body at all"),
        EdgeBody("whitespace-body", C, b" \n", "a body of whitespace only"),
        # Chat content parts.
        EdgeBody(
            "parts-text-only",
            CHAT,
            chat(b'[{"type":"text","text":"Say"},{"type":"text","text":"hi"}]'),
            "control: two text parts",
        ),
        EdgeBody(
            "parts-text-and-image",
            CHAT,
            chat(
                b'[{"type":"text","text":"What is this?"},'
                b'{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}}]'
            ),
            "a text part and an image_url part (a text-only model)",
        ),
        EdgeBody(
            "parts-text-and-unknown-type",
            CHAT,
            chat(b'[{"type":"text","text":"hi"},{"type":"hologram","hologram":"x"}]'),
            "a text part and a part of a type no API defines",
        ),
        EdgeBody(
            "parts-text-without-type",
            CHAT,
            chat(b'[{"text":"hi"}]'),
            "a part with text and no type",
        ),
        EdgeBody(
            "parts-input-text-in-chat",
            CHAT,
            chat(b'[{"type":"input_text","text":"hi"}]'),
            "a responses-style input_text part in a chat message",
        ),
        # Control characters.
        EdgeBody(
            "escaped-nul",
            C,
            completions(b"", b'"hi \\u0000 there"'),
            "an escaped U+0000 in the prompt (valid JSON)",
        ),
        EdgeBody(
            "raw-tab-in-string",
            C,
            completions(b"", b'"hi\tthere"'),
            "a raw TAB inside a string (strict JSON forbids it)",
        ),
        EdgeBody(
            "raw-newline-in-string",
            CHAT,
            chat(b'"hi\nthere"'),
            "a raw newline inside a string",
        ),
        EdgeBody(
            "raw-nul-in-string",
            C,
            completions(b"", b'"hi\x00there"'),
            "a raw NUL byte inside a string",
        ),
        EdgeBody(
            "raw-del-in-string",
            C,
            completions(b"", b'"hi\x7fthere"'),
            "a raw DEL (0x7F) inside a string (JSON allows it)",
        ),
        # Size.
        EdgeBody(
            "long-single-token",
            C,
            completions(b"", long_token),
            f"one {LONG_TOKEN_BYTES // 1024} KB word with no space (past the model's length)",
        ),
        EdgeBody(
            "long-single-token-ignored-field",
            C,
            completions(b',"user":%s' % long_token),
            f"a {LONG_TOKEN_BYTES // 1024} KB word in a field routing ignores",
        ),
        # Syntax around the object.
        EdgeBody(
            "trailing-garbage",
            C,
            completions(b"") + b"garbage",
            "bytes after the object",
        ),
        EdgeBody(
            "second-object",
            C,
            completions(b"") + completions(b""),
            "a second object after the first",
        ),
        EdgeBody(
            "trailing-comma",
            C,
            completions(b","),
            "a comma after the last member",
        ),
        EdgeBody(
            "single-quotes",
            C,
            b"{'model':%s,'prompt':'hi','max_tokens':1}" % m,
            "single-quoted keys and strings",
        ),
        EdgeBody(
            "comment",
            C,
            b"/* c */" + completions(b""),
            "a comment before the object",
        ),
        # Types a lax decoder coerces.
        EdgeBody(
            "stream-string-false",
            C,
            completions(b',"stream":"false"'),
            'stream as the string "false"',
        ),
        EdgeBody(
            "stream-string-true",
            C,
            completions(b',"stream":"TRUE"'),
            'stream as the string "TRUE" (the answer is streamed)',
        ),
        EdgeBody(
            "stream-string-maybe",
            C,
            completions(b',"stream":"maybe"'),
            "stream as a string that is no boolean",
        ),
        EdgeBody(
            "stream-int-0",
            C,
            completions(b',"stream":0'),
            "stream as the integer 0",
        ),
        EdgeBody(
            "stream-null",
            C,
            completions(b',"stream":null'),
            "stream as null",
        ),
        EdgeBody(
            "empty-cache-salt",
            C,
            completions(b',"cache_salt":""'),
            "an empty cache_salt",
        ),
        EdgeBody(
            "number-cache-salt",
            C,
            completions(b',"cache_salt":5'),
            "a number as cache_salt",
        ),
    )


# What vLLM 0.32 answers each body with (CPU, the real-vLLM tests' tiny Qwen3, a 512-token
# context), as measured by e2e/real_vllm/test_edge_bodies.py and shown in docs/reliability.md.
VLLM_STATUS: dict[str, int] = {
    "plain-completions": 200,
    "plain-chat": 200,
    "plain-responses": 200,
    "surrounding-whitespace": 200,
    "surrogate-pair-escape": 200,
    "lone-surrogate-prompt": 400,
    "lone-low-surrogate-prompt": 400,
    "lone-surrogate-message": 400,
    "lone-surrogate-responses": 400,
    "lone-surrogate-role": 200,
    "lone-surrogate-model": 400,
    "lone-surrogate-cache-salt": 400,
    "lone-surrogate-ignored-field": 200,
    "raw-0xff-prompt": 400,
    "raw-0xff-message": 400,
    "raw-cesu-surrogate": 400,
    "utf8-bom": 200,
    "utf16-body": 200,
    "1e400-temperature": 400,
    "minus-1e400-temperature": 400,
    "1e400-max-tokens": 400,
    "1e400-ignored-field": 200,
    "1e400-model": 400,
    "nan-temperature": 400,
    "infinity-temperature": 400,
    "minus-infinity-ignored-field": 200,
    "nan-ignored-field": 200,
    "huge-int-max-tokens": 400,
    "huge-int-seed": 400,
    "u64-max-seed": 400,
    "huge-int-ignored-field": 200,
    "int-5000-digits": 400,
    "float-max-tokens": 200,
    "nesting-900": 200,
    "nesting-1025": 400,
    "nesting-10001": 400,
    "whitespace-model": 404,
    "empty-model": 200,
    "padded-model": 404,
    "no-model": 200,
    "null-model": 200,
    "number-model": 400,
    "duplicate-model-last-served": 200,
    "duplicate-model-first-served": 404,
    "duplicate-prompt": 200,
    "duplicate-messages": 200,
    "root-array": 400,
    "root-string": 400,
    "root-number": 400,
    "root-null": 400,
    "root-true": 400,
    "empty-body": 400,
    "whitespace-body": 400,
    "parts-text-only": 200,
    "parts-text-and-image": 400,
    "parts-text-and-unknown-type": 400,
    "parts-text-without-type": 400,
    "parts-input-text-in-chat": 400,
    "escaped-nul": 200,
    "raw-tab-in-string": 400,
    "raw-newline-in-string": 400,
    "raw-nul-in-string": 400,
    "raw-del-in-string": 200,
    "long-single-token": 400,
    "long-single-token-ignored-field": 200,
    "trailing-garbage": 400,
    "second-object": 400,
    "trailing-comma": 400,
    "single-quotes": 400,
    "comment": 400,
    "stream-string-false": 200,
    "stream-string-true": 200,
    "stream-string-maybe": 400,
    "stream-int-0": 200,
    "stream-null": 200,
    "empty-cache-salt": 400,
    "number-cache-salt": 400,
}
