"""vLLM's OpenAI API as the pods speak it: request parsing and response / stream shapes.

Three endpoints, each plain or streamed (``"stream": true``, Server-Sent Events):

- ``/v1/completions``: ``prompt`` is a string, a list of token ids, or a one-element
  list of either. Chunks are ``text_completion`` objects; with
  ``stream_options.include_usage`` a last chunk has ``choices: []`` and the usage; the
  stream ends with ``data: [DONE]``.
- ``/v1/chat/completions``: ``messages`` and ``tools`` rendered by
  ``tokenizer.render_chat``. The first chunk's delta is
  ``{"role": "assistant", "content": ""}``, then one chunk per token; usage chunk and
  ``[DONE]`` as above.
- ``/v1/responses``: ``input`` (a string, or items: messages, function calls and their
  outputs) after ``instructions`` (a system message), with its function tools. Streamed
  as ``event: <type>`` / ``data: <json>`` pairs from ``response.created`` to
  ``response.completed``, with no ``[DONE]``, as vLLM does.

Both read the conversation as vLLM hands it to the chat template
(``extproc.request.chat_input``: text parts joined, an assistant's ``tool_calls``, a
function call item as one, tool outputs as ``tool`` messages, tools as the template gets
them). The pods act as vLLM started with ``--enable-auto-tool-choice --tool-call-parser
hermes``: ``tools`` and ``tool_choice`` are checked as vLLM checks them, ``"auto"``,
``"none"`` or none gets text, and a forced choice (a named function, or ``"required"``)
gets a tool call (``tool_calls.py``), a ``tool_calls`` entry or a ``function_call``
output item, whole or streamed.

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
``system_fingerprint`` of every completions and chat body and chunk. Text always stops
at the token limit: ``finish_reason`` is ``"length"``, a Responses object is
``"incomplete"`` with ``incomplete_details.reason`` ``"max_output_tokens"``, as vLLM says;
a tool call ends when it is written, unless the limit comes first.
Fields follow vLLM 0.32's non-null fields (``e2e/real_vllm/test_sim_parity.py`` checks).

Errors have vLLM's body ``{"error": {"message", "type", "param", "code"}}`` with ``code``
the HTTP status: 400 ``BadRequestError``, 404 ``NotFoundError`` for a model that is
neither the served one nor one of its LoRA adapters (``lora.py``); a
body that does not fit vLLM's request model (a tool that is not an object, a function
without a name) is a 400 of type ``"Bad Request"``, as vLLM's validation answers it.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Any, Literal

import orjson

from extproc.errors import BadRequest
from extproc.request.chat_input import ChatInput, NotExact, chat_input, responses_input
from extproc.request.parse import Api, load_body, stream_flag
from extproc.request.tokens import SegmentTokenizer
from extproc.sim.engine import FinishedRequest, TokenOutput
from extproc.sim.tokenizer import VOCAB_SIZE, ChatMessage, ToolCall, render_chat, tokenize
from extproc.sim.tool_calls import ToolCallAnswer, plan_tool_call

Kind = Literal["completion", "chat", "responses"]
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # vLLM's bounds on ``seed``
_FINITE_KEYS = ("temperature", "repetition_penalty")  # vLLM: "must be a finite number"
# Parts of the Responses API that a chat message may not hold: vLLM 0.32 answers 400.
_RESPONSES_ONLY_PARTS = frozenset({"input_text"})
_MAX_TOKENS_KEYS: dict[Kind, tuple[str, ...]] = {
    "completion": ("max_tokens",),
    "chat": ("max_completion_tokens", "max_tokens"),
    "responses": ("max_output_tokens",),
}


class ApiError(Exception):
    """An error answered to the client with vLLM's error body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, err_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.err_type)


def error_body(
    status: int, message: str, param: str | None = None, err_type: str | None = None
) -> dict[str, Any]:
    """vLLM's error body; ``err_type`` defaults to the status's (``BadRequestError``...)."""
    if err_type is None:
        err_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def _invalid(message: str, param: str, value: object = None) -> ApiError:
    """A 400 as vLLM words a request validator's refusal (``VLLMValidationError``)."""
    extras = f"parameter={param}" if value is None else f"parameter={param}, value={value}"
    return ApiError(400, f"{message} ({extras})", param)


def _malformed(kind: str, loc: str, message: str) -> ApiError:
    """A 400 as vLLM words a body that does not fit its request model (pydantic's)."""
    error = {"type": kind, "loc": loc, "msg": message}
    return ApiError(400, f"1 validation error:\n  {error}", loc, "Bad Request")


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
    tool_call: ToolCallAnswer | None = None  # the answer, when tool_choice forces a call
    tools: tuple[dict[str, Any], ...] = ()  # a responses request's, echoed back
    tool_choice: Any = "none"  # likewise

    @property
    def output_words(self) -> tuple[str, ...] | None:
        """The engine's preset output: the tool call, cut at ``max_tokens``."""
        if self.tool_call is None:
            return None
        return self.tool_call.words[: self.max_tokens]

    @property
    def num_output_tokens(self) -> int:
        """Tokens the engine generates: ``max_tokens``, or the tool call's, if fewer."""
        words = self.output_words
        return self.max_tokens if words is None else len(words)


def fit_context(req: GenerationRequest, max_model_len: int) -> GenerationRequest:
    """vLLM's length rules: ``max_tokens`` over the context is refused, a prompt longer
    than the context too, one that fills it leaves no room for a token, and ``max_tokens``
    is lowered to the room left.

    Raises:
        ApiError: 400, worded as vLLM words it.
    """
    if req.max_tokens > max_model_len:
        raise _invalid(
            f"max_tokens={req.max_tokens} cannot be greater than max_model_len="
            f"{max_model_len}. Please request fewer output tokens.",
            "max_tokens",
            value=req.max_tokens,
        )
    num_prompt = len(req.prompt_token_ids)
    if num_prompt > max_model_len:
        raise _invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {num_prompt} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            value=num_prompt,
        )
    if num_prompt == max_model_len:
        raise ApiError(
            400,
            f"The decoder prompt (length {num_prompt}) plus the number of requested output "
            f"tokens (at least 1) is longer than the maximum model length of {max_model_len}. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens "
            "(prompt + requested output tokens).",
        )
    return replace(req, max_tokens=min(req.max_tokens, max_model_len - num_prompt))


def decode_body(raw: bytes) -> dict[str, Any]:
    """A request body decoded as vLLM's server decodes it (``json.loads`` on the bytes, as
    Starlette does: a BOM, UTF-16, ``NaN``, ``1e400``, lone surrogate escapes taken), with
    extproc's decoder (orjson first, the standard library only where orjson refuses).

    Raises:
        ApiError: 400 for what vLLM refuses (not JSON as it reads it, not an object).
    """
    try:
        return load_body(raw, keep_surrogates=True)
    except BadRequest as e:
        raise ApiError(400, e.message, "body") from None


def parse_request(
    kind: Kind,
    body: Any,
    served_model: str,
    default_max_tokens: int,
    tokenizer: SegmentTokenizer | None = None,
    adapters: Collection[str] = (),
) -> GenerationRequest:
    """Validate a request body as vLLM would and render its prompt to tokens (with
    ``tokenizer`` if given, else the pseudo-tokenizer). ``model`` may name one of
    ``adapters`` (the pod's LoRA adapters).

    Raises:
        ApiError: 400 for a malformed body, 404 for a model this pod does not serve.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is None or model == "":  # as vLLM: the served model, never an adapter
        model = served_model
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    _check_utf8(model, "model")
    if model != served_model and model not in adapters:
        raise ApiError(
            404, f"The model `{model}` does not exist. Valid aliases: {served_model}.", "model"
        )
    try:
        stream = stream_flag(body.get("stream"))  # pydantic's lax bool, as vLLM reads it
    except BadRequest:
        raise ApiError(400, "stream must be a boolean", "stream") from None
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    include_usage = bool(options and options.get("include_usage"))
    max_tokens = default_max_tokens
    for key in _MAX_TOKENS_KEYS[kind]:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():  # pydantic's lax int: 1.0 is 1
            value = int(value)
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
    if salt is not None:
        _check_utf8(salt, "cache_salt")
    seed = body.get("seed") or 0
    if not isinstance(seed, int) or isinstance(seed, bool) or not _INT64_MIN <= seed <= _INT64_MAX:
        raise ApiError(400, "seed must be a 64-bit integer", "seed")
    for key in _FINITE_KEYS:
        value = body.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            raise _invalid(f"{key} must be a finite number, got {value}.", key, value)
    try:
        return _generation_request(
            kind, body, model, max_tokens, salt, seed, stream, include_usage, tokenizer
        )
    except UnicodeEncodeError as e:  # a lone surrogate in text vLLM's tokenizer meets
        raise ApiError(400, f"the prompt cannot be tokenized: {e.reason}", "prompt") from None


def _generation_request(
    kind: Kind,
    body: dict[str, Any],
    model: str,
    max_tokens: int,
    salt: str | None,
    seed: int,
    stream: bool,
    include_usage: bool,
    tokenizer: SegmentTokenizer | None,
) -> GenerationRequest:
    """``parse_request``'s request, its prompt rendered and tokenized."""
    call = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: Any = "none"
    if kind == "completion":
        tokens = _completion_prompt(body.get("prompt"), tokenizer)
    else:
        if kind == "chat":
            _check_messages(body.get("messages"))
            tool_choice = _chat_tool_choice(body)
            chat = _chat_input(chat_input, body)
        else:
            _check_input(body.get("input"), body.get("instructions"))
            chat = _chat_input(responses_input, body)
            tool_choice = _responses_tool_choice(body, chat)
            tools = tuple(body.get("tools") or ())
        if tokenizer is None:
            messages = [to_chat_message(m) for m in chat.messages]
            add_generation_prompt = bool(chat.variables.get("add_generation_prompt"))
            tokens = render_chat(messages, chat.tools or (), add_generation_prompt)
        else:
            api = Api.CHAT_COMPLETIONS if kind == "chat" else Api.RESPONSES
            tokens = _exact_tokens(tokenizer, api, body)
        if tool_choice == "required" or isinstance(tool_choice, dict):
            name = _function_name(tool_choice) if isinstance(tool_choice, dict) else None
            call = plan_tool_call(chat.tools or (), name, tokens, seed)
    if not tokens:
        raise ApiError(400, "The prompt is empty.", "prompt")
    return GenerationRequest(
        kind, model, tuple(tokens), max_tokens, salt, seed, stream, include_usage,
        call, tools, tool_choice,
    )  # fmt: skip


def _check_utf8(text: str, param: str) -> None:
    """vLLM refuses a model or salt with no UTF-8 form (a lone surrogate escape): 400."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} is not valid Unicode (a lone surrogate)", param) from None


def parse_lora_load(body: Any) -> tuple[str, str, bool]:
    """``/v1/load_lora_adapter``'s body as vLLM's ``LoadLoRAAdapterRequest`` takes it:
    ``(lora_name, lora_path, load_inplace)``.

    Raises:
        ApiError: 400, pydantic's wording, for a missing or mistyped field.
    """
    fields = _object_body(body)
    name, path = (_string_field(fields, key) for key in ("lora_name", "lora_path"))
    inplace = fields.get("load_inplace", False)
    if not isinstance(inplace, bool):
        raise _malformed("bool_type", "body.load_inplace", "Input should be a valid boolean")
    return name, path, inplace


def parse_lora_unload(body: Any) -> str:
    """``/v1/unload_lora_adapter``'s body (``UnloadLoRAAdapterRequest``): the name.

    Raises:
        ApiError: 400, pydantic's wording, for a missing or mistyped ``lora_name``.
    """
    return _string_field(_object_body(body), "lora_name")


def _object_body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _malformed("model_attributes_type", "body", _NOT_AN_OBJECT)
    return body


def _string_field(body: dict[str, Any], key: str) -> str:
    if key not in body:
        raise _malformed("missing", f"body.{key}", "Field required")
    value = body[key]
    if not isinstance(value, str):
        raise _malformed("string_type", f"body.{key}", "Input should be a valid string")
    return value


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


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message must be an object with a string role", "messages")
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                _check_content_part(part)


def _check_content_part(part: Any) -> None:
    """As vLLM's request model: a content part is an object, and a text part's ``text`` a
    string (vLLM's own parser would take a bare string, but validation refuses it first)."""
    if not isinstance(part, dict):
        raise _malformed("dict_type", "body.messages.content", "Input should be a valid dictionary")
    part_type = part.get("type")
    if isinstance(part_type, str) and part_type in _RESPONSES_ONLY_PARTS:
        raise _malformed(
            "union_tag_invalid",
            "body.messages.content",
            f"Input tag '{part_type}' found using 'type' does not match any of the expected tags",
        )
    if part.get("type") == "text" and not isinstance(part.get("text"), str):
        raise _malformed(
            "string_type", "body.messages.content.text", "Input should be a valid string"
        )


def _check_input(input_: Any, instructions: Any) -> None:
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "instructions must be a string", "instructions")
    if not (isinstance(input_, str) or (isinstance(input_, list) and input_)):
        raise ApiError(400, "input must be a string or a non-empty list of items", "input")


def _chat_input(build: Callable[[dict[str, Any]], ChatInput], body: dict[str, Any]) -> ChatInput:
    """The messages and tools as vLLM hands them to the chat template
    (``request.chat_input``, shared with the real tokenizer's path)."""
    try:
        return build(body)
    except NotExact as e:
        raise ApiError(400, str(e)) from None


def to_chat_message(message: dict[str, Any]) -> ChatMessage:
    """A ``chat_input`` message for the pseudo-tokenizer's template: role, text and the
    assistant's calls, arguments as the template writes them (JSON of the parsed object)."""
    calls = tuple(
        ToolCall(
            str(c["function"].get("name")),
            json.dumps(c["function"]["arguments"], ensure_ascii=False),
        )
        for c in message.get("tool_calls", ())
    )
    return ChatMessage(message["role"], message["content"], calls)


def _function_name(tool_choice: dict[str, Any]) -> str:
    """The function a named ``tool_choice`` forces (chat's nested form, or responses')."""
    function = tool_choice.get("function")
    return str(function["name"] if isinstance(function, dict) else tool_choice["name"])


_CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def _chat_tool_choice(body: dict[str, Any]) -> Any:
    """``tools`` and ``tool_choice`` checked as vLLM's ``ChatCompletionRequest`` checks
    them; returns the tool choice in effect (``"auto"`` when tools come without one)."""
    tools = body.get("tools")
    if tools == []:
        raise _invalid(
            "`tools` must not be an empty array. Either provide at least one tool or omit "
            "the field entirely.",
            "tools",
        )
    if tools is not None:
        if not isinstance(tools, list):
            raise _malformed("list_type", "body.tools", "Input should be a valid list")
        for i, tool in enumerate(tools):
            _check_function_tool(tool, f"body.tools.{i}")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice in (None, "none"):
        return "none"
    if tools is None:
        raise _invalid("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice in ("auto", "required"):
        return choice
    if not isinstance(choice, dict):
        raise _invalid(
            f"Invalid value for `tool_choice`: {choice}! "
            'Only named tools, "none", "auto" or "required" are supported.',
            "tool_choice",
        )
    function = choice.get("function")
    if not isinstance(function, dict):
        raise _invalid(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_USAGE}",
            "tool_choice.function",
        )
    name = function.get("name")
    if name is None:
        raise _invalid(
            f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_USAGE}",
            "tool_choice.function.name",
        )
    if not isinstance(name, str) or not name:
        raise _invalid(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_USAGE}",
            "tool_choice.function.name",
        )
    if all(tool["function"]["name"] != name for tool in tools):
        raise _invalid(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )
    return choice


_NOT_AN_OBJECT = "Input should be a valid dictionary or object to extract fields from"


def _check_function_tool(tool: Any, loc: str) -> None:
    """A chat tool as vLLM's ``ChatCompletionToolsParam`` takes it."""
    if not isinstance(tool, dict):
        raise _malformed("model_attributes_type", loc, _NOT_AN_OBJECT)
    if tool.get("type", "function") != "function":
        raise _malformed("literal_error", f"{loc}.type", "Input should be 'function'")
    function = tool.get("function")
    if function is None:
        raise _malformed("missing", f"{loc}.function", "Field required")
    if not isinstance(function, dict):
        raise _malformed("model_attributes_type", f"{loc}.function", _NOT_AN_OBJECT)
    if "name" not in function:
        raise _malformed("missing", f"{loc}.function.name", "Field required")
    if not isinstance(function["name"], str):
        raise _malformed("string_type", f"{loc}.function.name", "Input should be a valid string")
    if not isinstance(function.get("parameters", {}), dict | None):
        raise _malformed(
            "dict_type", f"{loc}.function.parameters", "Input should be a valid dictionary"
        )


def _responses_tool_choice(body: dict[str, Any], chat: ChatInput) -> Any:
    """``tool_choice`` checked as vLLM's ``ResponsesRequest`` checks it, against the
    function tools ``chat`` renders (namespaced ones flattened to ``<namespace>__<name>``,
    which a unique local name selects too); returns it as vLLM echoes it."""
    choice = body.get("tool_choice", "auto")
    names = [tool["function"]["name"] for tool in chat.tools or ()]
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not body.get("tools"):
        if choice == "required":
            raise _invalid(
                "Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice"
            )
        if named:
            raise _invalid("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
        return "none"
    if not named:
        return choice
    name = choice.get("name")
    local = [n for n in names if n.endswith(f"__{name}")]
    if name in names:
        return choice
    if len(local) > 1:
        raise _invalid(
            f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
            f"({', '.join(local)}). Select it by its full '<namespace>__<name>' name.",
            "tool_choice",
        )
    if len(local) == 1:
        return {**choice, "name": local[0]}
    raise _invalid("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")


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
        self.call = req.tool_call
        self._item_id = ("fc_" if self.call else "msg_") + uuid.uuid4().hex
        self._seq = 0

    def full(self, fin: FinishedRequest) -> dict[str, Any]:
        if self.req.kind == "responses":
            return self._response_object(fin)
        choice: dict[str, Any] = {"index": 0}
        finish = fin.finish_reason
        if self.req.kind == "completion":
            choice["text"] = fin.output_text
        elif self.call is not None:
            num_tokens = len(fin.output_token_ids)
            choice["message"] = self.call.message(num_tokens)
            finish = self.call.finish(num_tokens)
        else:
            choice["message"] = {"role": "assistant", "content": fin.output_text}
        choice.update(logprobs=None, finish_reason=finish, stop_reason=None)
        return {**self._envelope(False), "choices": [choice], "usage": _usage(fin, self.req.kind)}

    def head(self) -> list[bytes]:
        if self.req.kind == "completion":
            return []
        if self.req.kind == "responses" and self.call is not None:
            return [
                self._event("response.created", response=self._response_object(None)),
                self._event("response.in_progress", response=self._response_object(None)),
            ]
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
        if self.call is not None:
            return self._tool_call_token(out)
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
        if self.call is not None:
            return self._tool_call_tail(fin)
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

    def _tool_call_token(self, out: TokenOutput) -> list[bytes]:
        """A tool call's token: what the parser streams once it is read (``tool_calls``)."""
        assert self.call is not None
        num_tokens = out.index + 1
        deltas = self.call.stream_deltas(num_tokens)
        if self.req.kind == "responses":
            frames = []
            for delta in deltas:
                if "name" in delta["function"]:
                    item = self._function_call_item(num_tokens, "in_progress")
                    frames.append(self._event("response.output_item.added", output_index=0,
                                              item={**item, "arguments": ""}))  # fmt: skip
                else:
                    frames.append(self._event("response.function_call_arguments.delta",
                                              item_id=self._item_id, output_index=0,
                                              delta=delta["function"]["arguments"]))  # fmt: skip
            return frames
        finish = self.call.finish(num_tokens) if out.finished else None
        if not deltas and finish is None:
            return []  # vLLM sends no chunk for a token the parser holds back
        delta = {"content": None, "tool_calls": deltas} if deltas else {}
        return [_sse(self._chunk({"delta": delta, "logprobs": None, "finish_reason": finish}))]

    def _tool_call_tail(self, fin: FinishedRequest) -> list[bytes]:
        assert self.call is not None
        num_tokens = len(fin.output_token_ids)
        name, arguments = self.call.streamed(num_tokens)
        response = self._response_object(fin)
        if name is None:  # cut before the call's name: nothing was streamed
            return [self._event("response.completed", response=response)]
        item = self._function_call_item(num_tokens, "completed")
        return [
            self._event("response.function_call_arguments.done", arguments=arguments,
                        item_id=self._item_id, output_index=0, name=name),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event("response.completed", response=response),
        ]  # fmt: skip

    def _function_call_item(self, num_tokens: int, status: str) -> dict[str, Any]:
        assert self.call is not None
        return {
            "arguments": self.call.streamed(num_tokens)[1],
            "call_id": self.call.id,
            "name": self.call.name,
            "type": "function_call",
            "id": self._item_id,
            "status": status,
        }

    def _output(self, fin: FinishedRequest) -> list[dict[str, Any]]:
        """A responses answer's output items: the tool call once parsed (streamed: once its
        name was, as vLLM answers with the items it streamed), else the text."""
        num_tokens = len(fin.output_token_ids)
        if self.call is None:
            text, item_id = fin.output_text, self._item_id
        elif self.call.parsed(num_tokens) or (
            self.req.stream and self.call.streamed(num_tokens)[0] is not None
        ):
            return [self._function_call_item(num_tokens, "completed")]
        else:
            text, item_id = self.call.text(num_tokens), "msg_" + self._item_id[3:]
        part = {"type": "output_text", "text": text, "annotations": []}
        return [{"id": item_id, "type": "message", "role": "assistant",
                 "status": "completed", "content": [part]}]  # fmt: skip

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
        status = "in_progress"
        if fin is not None:
            output = self._output(fin)
            # text always stops at the token limit; a tool call may end first
            num_tokens = len(fin.output_token_ids)
            cut = self.call is None or self.call.finish(num_tokens) == "length"
            status = "incomplete" if cut else "completed"
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
            "status": status,
            "output": output,
            "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "max_output_tokens": self.req.max_tokens,
            "parallel_tool_calls": True,
            "tool_choice": self.req.tool_choice,
            "tools": list(self.req.tools),
            "temperature": 1.0,
            "top_p": 1.0,
            "background": False,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "service_tier": "auto",
            "truncation": "disabled",
        }
