"""vLLM's OpenAI API as the pods speak it: request parsing and response / stream shapes.

Three endpoints, each plain or streamed (``"stream": true``, Server-Sent Events):

- ``/v1/completions``: ``prompt`` is a string, a list of token ids, or a one-element
  list of either. Chunks are ``text_completion`` objects; with
  ``stream_options.include_usage`` a last chunk has ``choices: []`` and the usage; the
  stream ends with ``data: [DONE]``.
- ``/v1/chat/completions``: ``messages`` rendered by ``tokenizer.render_chat``. The first
  chunk's delta is ``{"role": "assistant", "content": ""}``, then one chunk per token;
  usage chunk and ``[DONE]`` as above.

- ``/v1/responses``: ``input`` (a string, or message items) after ``instructions`` (a
  system message). Streamed as ``event: <type>`` / ``data: <json>`` pairs from
  ``response.created`` to ``response.completed``, with no ``[DONE]``, as vLLM does.

With a real tokenizer (``sim-pods --tokenizer DIR``: a Hugging Face ``tokenizer.json`` and
``tokenizer_config.json``), prompts are rendered and tokenized as vLLM does, by
``extproc.request.tokens`` (the model's chat template; a responses request as vLLM builds
its messages, ``request.chat_input``), so a router that tokenizes with the same directory
(the precise-prefix-cache plugin) sees the pod's token ids; a request that cannot be
tokenized so is a 400. The output stays the simulated words, whose token ids are the
pseudo-tokenizer's.

Usage everywhere counts ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
``prompt_tokens_details.cached_tokens`` (Responses: ``input_tokens``,
``input_tokens_details.cached_tokens``, ...). The serving pod's name is in
``system_fingerprint`` of every completions and chat body and chunk. Output always stops
at the token limit: ``finish_reason`` is ``"length"``, a Responses object is
``"incomplete"`` with ``incomplete_details.reason`` ``"max_output_tokens"``, as vLLM says.
Fields follow vLLM 0.32's non-null fields (``e2e/real_vllm/test_sim_parity.py`` checks).

Errors have vLLM's body ``{"error": {"message", "type", "param", "code"}}`` with ``code``
the HTTP status: 400 ``BadRequestError``, 404 ``NotFoundError`` for an unknown model.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

import orjson

from extproc.request.parse import Api
from extproc.request.tokens import NotExact, SegmentTokenizer
from extproc.sim.engine import FinishedRequest, TokenOutput
from extproc.sim.tokenizer import VOCAB_SIZE, ChatMessage, render_chat, tokenize

Kind = Literal["completion", "chat", "responses"]
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_MAX_TOKENS_KEYS: dict[Kind, tuple[str, ...]] = {
    "completion": ("max_tokens",),
    "chat": ("max_completion_tokens", "max_tokens"),
    "responses": ("max_output_tokens",),
}


class ApiError(Exception):
    """An error answered to the client with vLLM's error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    err_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: Kind
    model: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None
    seed: int
    stream: bool
    include_usage: bool


def parse_request(
    kind: Kind,
    body: Any,
    served_model: str,
    default_max_tokens: int,
    tokenizer: SegmentTokenizer | None = None,
) -> GenerationRequest:
    """Validate a request body as vLLM would and render its prompt to tokens (with
    ``tokenizer`` if given, else the pseudo-tokenizer).

    Raises:
        ApiError: 400 for a malformed body, 404 for a model this pod does not serve.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model", served_model)
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    include_usage = bool(options and options.get("include_usage"))
    max_tokens = default_max_tokens
    for key in _MAX_TOKENS_KEYS[kind]:
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ApiError(400, f"{key} must be an integer of at least 1, got {value!r}", key)
        max_tokens = value
        break
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(
            400, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    seed = body.get("seed") or 0
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ApiError(400, "seed must be an integer", "seed")
    if kind == "completion":
        tokens = _completion_prompt(body.get("prompt"), tokenizer)
    else:
        if kind == "chat":
            messages = _chat_messages(body.get("messages"))
        else:
            messages = _responses_messages(body.get("input"), body.get("instructions"))
        if tokenizer is None:
            tokens = render_chat(messages)
        else:
            api = Api.CHAT_COMPLETIONS if kind == "chat" else Api.RESPONSES
            tokens = _exact_tokens(tokenizer, api, body)
    if not tokens:
        raise ApiError(400, "The prompt is empty.", "prompt")
    return GenerationRequest(
        kind, model, tuple(tokens), max_tokens, salt, seed, stream, include_usage
    )


def _exact_tokens(tokenizer: SegmentTokenizer, api: Api, body: dict[str, Any]) -> list[int]:
    try:
        return tokenizer.request_tokens(api, body)
    except NotExact as e:
        raise ApiError(400, f"the prompt cannot be tokenized: {e}") from None


def _completion_prompt(prompt: Any, tokenizer: SegmentTokenizer | None) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            return tokenize(prompt)
        return _exact_tokens(tokenizer, Api.COMPLETIONS, {"prompt": prompt})
    vocab_size = VOCAB_SIZE if tokenizer is None else tokenizer.tokenizer.get_vocab_size()
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt
    ):
        return prompt
    raise ApiError(
        400,
        "prompt must be a string, a list of token ids below the vocabulary size, "
        "or a one-element list of either",
        "prompt",
    )


def _content_text(content: Any, param: str) -> str:
    """A message's content: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and isinstance(part.get("text"), str)):
                raise ApiError(400, "only text content parts are supported", param)
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, "content must be a string or a list of text parts", param)


def _chat_messages(messages: Any) -> list[ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message must be an object with a string role", "messages")
        out.append(ChatMessage(m["role"], _content_text(m.get("content"), "messages")))
    return out


def _responses_messages(input_: Any, instructions: Any) -> list[ChatMessage]:
    out = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "instructions must be a string", "instructions")
        out.append(ChatMessage("system", instructions))
    if isinstance(input_, str):
        out.append(ChatMessage("user", input_))
    elif isinstance(input_, list) and input_:
        for item in input_:
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                raise ApiError(400, "only message input items are supported", "input")
            if not isinstance(item.get("role"), str):
                raise ApiError(400, "each input message needs a string role", "input")
            out.append(ChatMessage(item["role"], _content_text(item.get("content"), "input")))
    else:
        raise ApiError(400, "input must be a string or a non-empty list of messages", "input")
    return out


def render_body(req: GenerationRequest) -> dict[str, Any]:
    """A render endpoint's answer: vLLM's ``GenerateRequest`` fields that carry values."""
    prefix = {"completion": "cmpl-", "chat": "chatcmpl-", "responses": "resp_"}[req.kind]
    return {
        "request_id": prefix + uuid.uuid4().hex,
        "token_ids": list(req.prompt_token_ids),
        "sampling_params": {"max_tokens": req.max_tokens},
        "model": req.model,
        "output_mode": "tokens",
        "stream": req.stream,
        "cache_salt": req.cache_salt,
        "priority": 0,
    }


def _sse(obj: Any, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _usage(fin: FinishedRequest, kind: Kind) -> dict[str, Any]:
    num_out = len(fin.output_token_ids)
    details: dict[str, int] = {"cached_tokens": fin.num_cached_tokens}
    if kind == "chat":  # vLLM 0.32 fills it for chat only; the sim does not model it
        details["created_cache_tokens"] = 0
    return {
        "prompt_tokens": fin.num_prompt_tokens,
        "total_tokens": fin.num_prompt_tokens + num_out,
        "completion_tokens": num_out,
        "prompt_tokens_details": details,
    }


class ResponseFormat:
    """Builds one request's body, or its stream: ``head``, ``token`` per token, ``tail``."""

    def __init__(self, req: GenerationRequest, pod_name: str) -> None:
        self.req = req
        self.pod_name = pod_name
        self.created = int(time.time())
        prefix = {"completion": "cmpl-", "chat": "chatcmpl-", "responses": "resp_"}[req.kind]
        self.id = prefix + uuid.uuid4().hex
        self._item_id = "msg_" + uuid.uuid4().hex
        self._seq = 0

    def full(self, fin: FinishedRequest) -> dict[str, Any]:
        if self.req.kind == "responses":
            return self._response_object(fin)
        choice: dict[str, Any] = {"index": 0}
        if self.req.kind == "completion":
            choice["text"] = fin.output_text
        else:
            choice["message"] = {"role": "assistant", "content": fin.output_text}
        choice.update(logprobs=None, finish_reason=fin.finish_reason, stop_reason=None)
        return {**self._envelope(False), "choices": [choice], "usage": _usage(fin, self.req.kind)}

    def head(self) -> list[bytes]:
        if self.req.kind == "completion":
            return []
        if self.req.kind == "chat":
            delta = {"role": "assistant", "content": ""}
            return [_sse(self._chunk({"delta": delta, "logprobs": None, "finish_reason": None}))]
        item = {"id": self._item_id, "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}  # fmt: skip
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.created", response=self._response_object(None)),
            self._event("response.in_progress", response=self._response_object(None)),
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", item_id=self._item_id, output_index=0,
                        content_index=0, part=part),
        ]  # fmt: skip

    def token(self, out: TokenOutput) -> list[bytes]:
        finish = "length" if out.finished else None
        choice: dict[str, Any]
        if self.req.kind == "completion":
            choice = {
                "text": out.text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            return [_sse(self._chunk(choice))]
        if self.req.kind == "chat":
            choice = {"delta": {"content": out.text}, "logprobs": None, "finish_reason": finish}
            return [_sse(self._chunk(choice))]
        return [self._event("response.output_text.delta", item_id=self._item_id, output_index=0,
                            content_index=0, delta=out.text, logprobs=[])]  # fmt: skip

    def tail(self, fin: FinishedRequest) -> list[bytes]:
        if self.req.kind != "responses":
            frames = []
            if self.req.include_usage:
                usage = _usage(fin, self.req.kind)
                frames.append(_sse({**self._envelope(True), "choices": [], "usage": usage}))
            return [*frames, SSE_DONE]
        part = {"type": "output_text", "text": fin.output_text, "annotations": []}
        response = self._response_object(fin)
        return [
            self._event("response.output_text.done", item_id=self._item_id, output_index=0,
                        content_index=0, text=fin.output_text, logprobs=[]),
            self._event("response.content_part.done", item_id=self._item_id, output_index=0,
                        content_index=0, part=part),
            self._event("response.output_item.done", output_index=0, item=response["output"][0]),
            self._event("response.completed", response=response),
        ]  # fmt: skip

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        obj = {"completion": "text_completion", "chat": "chat.completion"}[self.req.kind]
        return {
            "id": self.id,
            "object": obj + ".chunk" if chunk and self.req.kind == "chat" else obj,
            "created": self.created,
            "model": self.req.model,
            "system_fingerprint": self.pod_name,
        }

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(True), "choices": [{"index": 0, **choice}]}

    def _event(self, event_type: str, **fields: Any) -> bytes:
        obj = {"type": event_type, "sequence_number": self._seq, **fields}
        self._seq += 1
        return _sse(obj, event_type)

    def _response_object(self, fin: FinishedRequest | None) -> dict[str, Any]:
        output: list[dict[str, Any]] = []
        usage = None
        if fin is not None:
            part = {"type": "output_text", "text": fin.output_text, "annotations": []}
            output = [{"id": self._item_id, "type": "message", "role": "assistant",
                       "status": "completed", "content": [part]}]  # fmt: skip
            u = _usage(fin, self.req.kind)
            usage = {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": fin.num_cached_tokens,
                    "cache_write_tokens": 0,
                    "input_tokens_per_turn": [],
                    "cached_tokens_per_turn": [],
                },
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {
                    "reasoning_tokens": 0,
                    "tool_output_tokens": 0,
                    "output_tokens_per_turn": [],
                    "tool_output_tokens_per_turn": [],
                },
                "total_tokens": u["total_tokens"],
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.req.model,
            # output always stops at the token limit, which vLLM reports as incomplete
            "status": "incomplete" if fin is not None else "in_progress",
            "output": output,
            "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if fin is not None else None,
            "max_output_tokens": self.req.max_tokens,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "temperature": 1.0,
            "top_p": 1.0,
            "background": False,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "service_tier": "auto",
            "truncation": "disabled",
        }
