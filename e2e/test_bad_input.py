"""The bad-request corpus through real Envoy: every case gets its specific JSON error, or
is routed where routing is the right answer; extproc stays up, its memory flat.

Requests without a body never reach extproc in the one-round configuration (Envoy
sends ext_proc no body message): Envoy's fallback policy sends them to a pod, whose own
answer the client gets. Bodies over Envoy's own limit get Envoy's 413.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import orjson
import pytest

from e2e.support import MODEL, RECORDED, metric
from extproc.sim.launch import Stack
from testkit.usage import usage_of

C, CHAT, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"
MB = 1024 * 1024


@dataclass(frozen=True)
class Case:
    path: str
    body: bytes | None
    status: int
    code: str | None = None  # extproc's error code; None: not extproc's answer
    by: str = "extproc"  # extproc | pod (routed, the pod answered) | envoy
    method: str = "POST"
    headers: dict[str, str | bytes] = field(default_factory=dict)
    chunked: bool = False  # sent in 7-byte chunks (Transfer-Encoding: chunked)


def j(value: object) -> bytes:
    return orjson.dumps(value)


def completion(**fields: object) -> bytes:
    return j({"model": MODEL, "prompt": "corpus", "max_tokens": 1, **fields})


def chat(messages: object, **fields: object) -> bytes:
    return j({"model": MODEL, "messages": messages, "max_tokens": 1, **fields})


def responses(**fields: object) -> bytes:
    return j({"model": MODEL, "max_output_tokens": 1, **fields})


def bad(path: str, body: bytes, code: str, status: int = 400, **kw: object) -> Case:
    return Case(path, body, status, code, **kw)  # type: ignore[arg-type]


def routed(path: str, body: bytes | None, status: int = 200, **kw: object) -> Case:
    return Case(path, body, status, None, "pod", **kw)  # type: ignore[arg-type]


USER = {"role": "user", "content": "hi"}
EIGHT_MB_PROMPT = completion(prompt="a" * (8 * MB))
MANY_MESSAGES = chat([USER] * 250_000)  # 7.5 MB: a quarter of a million messages

CORPUS: dict[str, Case] = {
    # not JSON, or not an object
    "invalid-json": bad(C, b"{not json", "invalid_json"),
    "truncated-json": bad(C, completion()[:-7], "invalid_json"),
    "truncated-mid-escape": bad(C, b'{"model":"sim-llm","prompt":"\\u12', "invalid_json"),
    "json-array": bad(C, b"[1,2]", "invalid_json"),
    "json-string": bad(C, b'"hello"', "invalid_json"),
    "json-null": bad(C, b"null", "invalid_json"),
    "nan": bad(C, b'{"model":"sim-llm","prompt":NaN}', "invalid_type"),  # decoded as vLLM does
    # routed, as vLLM decodes them (e2e/real_vllm/test_edge_bodies.py), and served by the
    # simulated pods, which decode as vLLM does
    "utf8-bom": routed(C, b"\xef\xbb\xbf" + completion()),
    "nan-in-extra-field": routed(C, completion()[:-1] + b',"x_extra":NaN}'),
    "non-utf8": bad(C, b'{"model":"sim-llm","prompt":"\xff\xfe\xfd"}', "invalid_encoding"),
    "latin1": bad(C, '{"model":"sim-llm","prompt":"café"}'.encode("latin-1"), "invalid_encoding"),
    "lone-surrogate-escape": routed(
        C, b'{"model":"sim-llm","prompt":"\\ud800"}', 400
    ),  # untokenizable
    "deeply-nested": bad(C, b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
    "deeply-nested-field": bad(
        C,
        b'{"model":"sim-llm","prompt":"x","x":' + b"[" * 2000 + b"]" * 2000 + b"}",
        "invalid_json",
    ),
    "gzip-body": bad(
        C, gzip.compress(completion()), "invalid_encoding", headers={"content-encoding": "gzip"}
    ),
    # no model: routed as the pods' one model, which vLLM (and the pod) defaults to
    "no-model": routed(C, j({"prompt": "x"})),
    "model-null": routed(C, j({"model": None, "prompt": "x"})),
    "model-empty": routed(C, j({"model": "", "prompt": "x"})),
    # wrong types in every field the parser reads
    "model-number": bad(C, j({"model": 7, "prompt": "x"}), "invalid_type"),
    "model-list": bad(C, j({"model": [MODEL], "prompt": "x"}), "invalid_type"),
    "unknown-model": bad(C, j({"model": "gpt-9", "prompt": "x"}), "model_not_found", 404),
    "salt-number": bad(C, completion(cache_salt=5), "invalid_type"),
    "salt-empty": bad(C, completion(cache_salt=""), "invalid_type"),
    "salt-object": bad(C, completion(cache_salt={"a": 1}), "invalid_type"),
    "stream-string": bad(C, completion(stream="maybe"), "invalid_type"),  # "yes": true
    "stream-number": bad(C, completion(stream=2), "invalid_type"),  # 0 and 1 are booleans
    "no-prompt": bad(C, j({"model": MODEL}), "missing_field"),
    "prompt-number": bad(C, completion(prompt=12), "invalid_type"),
    "prompt-object": bad(C, completion(prompt={"text": "x"}), "invalid_type"),
    "prompt-mixed-list": bad(C, completion(prompt=["a", 1]), "invalid_type"),
    "prompt-bools": bad(C, completion(prompt=[True]), "invalid_type"),
    "no-messages": bad(CHAT, j({"model": MODEL}), "missing_field"),
    "messages-string": bad(CHAT, chat("hi"), "invalid_type"),
    "messages-object": bad(CHAT, chat(USER), "invalid_type"),
    "no-input": bad(R, responses(), "missing_field"),
    "input-number": bad(R, responses(input=5), "invalid_type"),
    "input-object": bad(R, responses(input=USER), "invalid_type"),
    # Kthena skips what it cannot read in a message (extproc too, then routes); the
    # pod refuses the body itself
    "message-string": routed(CHAT, chat(["hi"]), 400),
    "message-without-role": routed(CHAT, chat([{"content": "x"}]), 400),
    "role-number": routed(CHAT, chat([{"role": 3, "content": "x"}]), 400),
    "content-number": routed(CHAT, chat([{"role": "user", "content": 3}]), 400),
    "content-object": routed(CHAT, chat([{"role": "user", "content": {"text": "x"}}]), 400),
    "part-string": routed(CHAT, chat([{"role": "user", "content": ["x"]}]), 400),
    "part-text-null": routed(
        CHAT, chat([{"role": "user", "content": [{"type": "text", "text": None}]}]), 400
    ),
    "part-type-object": routed(
        CHAT, chat([{"role": "user", "content": [{"type": {"url": "x"}}]}]), 400
    ),
    "parts-nested-deep": routed(CHAT, chat([{"role": "user", "content": [[[[["deep"]]]]]}]), 400),
    "system-number": routed(CHAT, chat([USER], system=5)),  # a field the pod ignores
    "input-item-string": routed(R, responses(input=["x"]), 400),
    "instructions-list": routed(R, responses(input="x", instructions=["x"]), 400),
    "input-message-role-null": routed(R, responses(input=[{"type": "message", "role": None}]), 400),
    # paths extproc does not route
    "embeddings": bad("/v1/embeddings", j({"model": MODEL, "input": "x"}), "unsupported_endpoint"),
    "upper-case-path": bad("/V1/COMPLETIONS", completion(), "unsupported_endpoint"),
    "root": bad("/", completion(), "unsupported_endpoint"),
    # routed: what the parser does not read, or reads leniently
    "unknown-role": routed(CHAT, chat([{"role": "wizard", "content": "x"}])),
    # (the simulated pod, like vLLM for a text model, refuses parts it cannot use)
    "unknown-part-types": routed(
        CHAT,
        chat(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                        {"type": "text", "text": "describe"},
                    ],
                }
            ]
        ),
        400,
    ),
    "unknown-fields": routed(C, completion(frobnicate={"a": [1, 2]}, logit_bias={"1": 2})),
    "unknown-input-items": routed(
        R, responses(input=[{"type": "function_call_output", "output": "4"}, USER])
    ),
    "null-content": routed(CHAT, chat([{"role": "assistant", "content": None}, USER])),
    "tool-call-turn": routed(
        CHAT,
        chat([USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}, USER]),
        400,  # as vLLM 0.32: a tool call without its function
    ),
    "empty-messages": routed(CHAT, chat([]), 400),  # routed; the pod refuses an empty chat
    "token-ids": routed(C, completion(prompt=[1, 2, 3])),
    "huge-message-array": routed(CHAT, chat([USER] * 20_000), 400),  # over the context
    "eight-mb-prompt": routed(C, EIGHT_MB_PROMPT, 400),  # routed; over the model's context
    "quarter-million-messages": routed(CHAT, MANY_MESSAGES, 400),
    "query-string": routed(C + "?debug=1&x=%00", completion()),
    "text-plain": routed(C, completion(), headers={"content-type": "text/plain"}),
    "no-content-type": routed(C, completion(), headers={"content-type": ""}),
    "chunked-body": routed(C, completion(), chunked=True),
    "chunked-body-bad-json": bad(
        C, b'{"model": "sim-llm", "prompt": ', "invalid_json", chunked=True
    ),
    "expect-100-continue": routed(C, completion(), headers={"expect": "100-continue"}),
    "long-session-header": routed(C, completion(), headers={"x-session-id": "s" * 8000}),
    "odd-session-header": routed(
        C, completion(), headers={"x-session-id": "!%'\"{}\\~ ü".encode()}
    ),
    "client-request-id": routed(C, completion(), headers={"x-request-id": "not-a-uuid"}),
    "many-headers": routed(C, completion(), headers={f"x-h{i}": "v" * 50 for i in range(80)}),
    "envoy-headers": routed(
        C,
        completion(),
        headers={
            "x-envoy-upstream-rq-timeout-ms": "1",
            "x-envoy-max-retries": "0",
            "x-envoy-retry-on": "none",
            "x-forwarded-for": "1.2.3.4",
        },
    ),
    "put": routed(C, completion(), 405, method="PUT"),
    # no body: extproc never sees it; the fallback pod answers
    "empty-body": routed(C, b"", 400),
    "get-no-body": routed(C, None, 405, method="GET"),
    "get-models": routed("/v1/models", None, 200, method="GET"),
    # over Envoy's 16 MiB buffer: Envoy's own 413, before extproc
    "seventeen-mb": Case(C, completion(prompt="a" * (17 * MB)), 413, by="envoy"),
}


def send(client: httpx.Client, case: Case) -> httpx.Response:
    body = case.body
    content = (body[i : i + 7] for i in range(0, len(body), 7)) if case.chunked and body else body
    # httpx normalises each header value, str or bytes, but its HeaderTypes admits no mix
    return client.request(case.method, case.path, content=content, headers=case.headers)  # type: ignore[arg-type]


def check(case: Case, resp: httpx.Response) -> None:
    assert resp.status_code == case.status, resp.text[:300]
    if case.by == "extproc":
        assert resp.headers["content-type"] == "application/json"
        error = resp.json()["error"]
        assert error["code"] == case.code and error["message"], error
        assert "x-sim-pod" not in resp.headers
    elif case.by == "pod":
        assert "x-sim-pod" in resp.headers, resp.headers
    else:
        assert "x-sim-pod" not in resp.headers


@pytest.fixture(scope="module")
def corpus_client(stack: Stack) -> Iterator[httpx.Client]:
    # Envoy closes a connection after some errors: a fresh one per request keeps cases apart.
    with httpx.Client(
        base_url=stack.url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0)
    ) as c:
        yield c


@pytest.mark.parametrize("name", list(CORPUS))
def test_bad_input_through_envoy(corpus_client: httpx.Client, name: str) -> None:
    check(CORPUS[name], send(corpus_client, CORPUS[name]))


SMALL = [name for name, case in CORPUS.items() if case.body is None or len(case.body) < MB]


def run_corpus(client: httpx.Client, names: list[str]) -> None:
    with ThreadPoolExecutor(4) as pool:
        for name, resp in zip(names, pool.map(lambda n: send(client, CORPUS[n]), names)):
            check(CORPUS[name], resp)


def test_repeated_corpus_keeps_extproc_up_and_its_memory_flat(
    stack: Stack, corpus_client: httpx.Client
) -> None:
    """The small cases until RSS settles (the allocator warms an arena per gRPC thread;
    4 to 10 rounds), 4 rounds more with RSS flat, then the whole corpus with the 8 MB
    bodies, which move RSS by tens of MB either way as the allocator keeps or returns
    them: survived, and reported."""
    recorded = metric(stack, *RECORDED)
    before = usage_of(stack.extproc.pid)
    for i in range(10):
        run_corpus(corpus_client, SMALL)
        warm, before = before, usage_of(stack.extproc.pid)
        if i >= 3 and abs(before.rss_bytes - warm.rss_bytes) < MB:
            break
    for _ in range(4):
        run_corpus(corpus_client, SMALL)
    after = usage_of(stack.extproc.pid)
    run_corpus(corpus_client, list(CORPUS))
    big = usage_of(stack.extproc.pid)
    assert stack.extproc.alive()
    print(
        f"extproc after warm-up: RSS {before.rss_bytes / MB:.1f} MB, {before.threads} threads, "
        f"{before.fds} fds; after {4 * len(SMALL)} more requests: RSS "
        f"{after.rss_bytes / MB:.1f} MB, {after.threads} threads, {after.fds} fds; after the "
        f"{len(CORPUS)} cases with the big bodies: RSS {big.rss_bytes / MB:.1f} MB"
    )
    assert after.rss_bytes - before.rss_bytes < 8 * MB, (before, after)  # < 28 KB a request
    assert big.fds <= before.fds + 2 and big.threads <= before.threads + 2
    log = stack.extproc.log_tail(1_000_000)
    assert "Traceback" not in log and "unexpected error" not in log
    assert metric(stack, *RECORDED) > recorded  # the routed cases were recorded too
