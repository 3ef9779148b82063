"""A forced tool call (``tool_choice`` a named function, or ``"required"``) answered as a
vLLM 0.32 pod serving Qwen3 with ``--enable-auto-tool-choice --tool-call-parser hermes``
answers it.

What the model writes. vLLM constrains the output to Hermes' structural tag (strict tool
calling is on by default), so the model writes Qwen's own tool-call markup and then its
end-of-turn token: ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`` and
``<|im_end|>``. The simulated model writes exactly that, one call (vLLM forces one for a
named function; ``"required"`` allows more, the simulation writes one, of a tool picked
by the prompt's hash), with ``ARGS`` a JSON object built from the tool's parameter schema
(``simulated_arguments``). The words are the rendering's (``tokenizer.split_words``), so
the call sent back as the next turn's assistant message re-renders to the tokens the
engine generated, as with text answers. They count toward ``max_tokens`` like any
output; the end-of-turn token is a completion token too.

What the client gets (the Hermes parser's reading of that text):

- whole: a message with ``content: ""`` and one ``tool_calls`` entry (``id``
  ``chatcmpl-tool-...``, ``arguments`` the JSON text); ``finish_reason`` ``"stop"`` for a
  named function, ``"tool_calls"`` for ``"required"``. Cut by ``max_tokens``:
  ``"length"``, and the call is still parsed once its JSON is complete; before that the
  partial text is the ``content`` and there are no ``tool_calls``.
- streamed (``stream_deltas``): nothing until the name's closing quote arrives; then
  ``{"index": 0, "id", "type": "function", "function": {"name"}}``; then each token's new
  argument text, ``{"index": 0, "function": {"arguments": ...}}`` (the parser strips
  trailing whitespace until the JSON is complete); tokens that add nothing send no chunk;
  the last chunk carries the finish reason (with an empty delta when it adds nothing).
- responses: a ``function_call`` output item (``status`` ``"completed"``, the response
  ``"completed"`` unless cut); streamed, ``response.output_item.added`` once the name is
  read, ``response.function_call_arguments.delta`` for the same argument text, then
  ``...arguments.done`` and ``response.output_item.done``.
"""

from __future__ import annotations

import json
import re
import struct
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import xxhash

from extproc.sim.tokenizer import (
    IM_END,
    SPECIAL_TEXT,
    TOOL_CALL,
    TOOL_CALL_END,
    WORDS,
    ToolCall,
    prompt_seed,
    split_words,
    tool_call_text,
)

ToolFinish = Literal["stop", "tool_calls"]  # named function, "required"
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')  # the parser's test for a whole name
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')
_EOS = SPECIAL_TEXT[IM_END]
_MAX_DEPTH = 4  # nested objects and arrays built from a schema, at most


@dataclass(frozen=True, slots=True)
class ToolCallAnswer:
    """The call a request is answered with, and what its first tokens read as."""

    name: str
    arguments: str  # JSON text, as the Hermes parser hands it on
    finish_reason: ToolFinish
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex[:16]}")
    # The model's output: the call's markup, then its end-of-turn token (read once a
    # token while streaming, so split once).
    words: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        markup = split_words(tool_call_text(ToolCall(self.name, self.arguments)))
        object.__setattr__(self, "words", (*markup, _EOS))

    def text(self, num_tokens: int) -> str:
        """The text of the first ``num_tokens`` words (a character cut short dropped, as
        vLLM's detokenizer holds it back); the end-of-turn token adds none."""
        words = self.words[:num_tokens]
        data = b"".join(w.encode(errors="surrogateescape") for w in words if w != _EOS)
        return data.decode(errors="ignore")

    def parsed(self, num_tokens: int) -> bool:
        """Whether the first ``num_tokens`` words hold the whole call's JSON."""
        return _call_json(self.text(num_tokens))[1]

    def message(self, num_tokens: int) -> dict[str, Any]:
        """The assistant message of a whole (non-streamed) answer."""
        if not self.parsed(num_tokens):
            return {"role": "assistant", "content": self.text(num_tokens)}
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return {"role": "assistant", "content": "", "tool_calls": [call]}

    def finish(self, num_tokens: int) -> str:
        return self.finish_reason if num_tokens == len(self.words) else "length"

    def streamed(self, num_tokens: int) -> tuple[str | None, str]:
        """The name (None until whole) and the argument text the parser has streamed
        once it read the first ``num_tokens`` words."""
        return _streamed(self.text(num_tokens))

    def stream_deltas(self, num_tokens: int) -> list[dict[str, Any]]:
        """The ``tool_calls`` entries of the chunk of token ``num_tokens - 1``: what the
        text up to it says beyond the text before it."""
        before = self.streamed(num_tokens - 1)
        now = self.streamed(num_tokens)
        deltas: list[dict[str, Any]] = []
        if now[0] is not None and before[0] is None:
            deltas.append(
                {"index": 0, "id": self.id, "type": "function", "function": {"name": now[0]}}
            )
        if len(now[1]) > len(before[1]):
            deltas.append({"index": 0, "function": {"arguments": now[1][len(before[1]) :]}})
        return deltas


def _call_json(text: str) -> tuple[str, bool]:
    """The call's JSON text so far (stripped, as the parser strips it), and whether it is
    whole: closed by ``</tool_call>`` or valid JSON already."""
    body = text.partition(SPECIAL_TEXT[TOOL_CALL])[2]
    body, closed, _ = body.partition(SPECIAL_TEXT[TOOL_CALL_END])
    body = body.strip()
    if closed:
        return body, True
    try:
        json.loads(body)
    except ValueError:
        return body, False
    return body, True


def _streamed(text: str) -> tuple[str | None, str]:
    """The name and the argument text the parser has streamed once it read ``text``."""
    body, whole = _call_json(text)
    name = _NAME.search(body)
    arguments = _ARGUMENTS.search(body)
    if arguments is None:
        return (name.group(1) if name else None), ""
    raw = body[arguments.end() :]
    if whole:  # drop the brace that closes the call, not the arguments
        raw = raw.rstrip().removesuffix("}").rstrip()
    return (name.group(1) if name else None), raw


def plan_tool_call(
    tools: Sequence[Mapping[str, Any]],
    name: str | None,
    prompt_token_ids: Sequence[int],
    seed: int,
) -> ToolCallAnswer:
    """The call a forced ``tool_choice`` gets.

    Args:
        tools: the request's function tools, as the template gets them.
        name: the function a named ``tool_choice`` forces; None for ``"required"``.
        prompt_token_ids: the prompt, which with ``seed`` fixes the call.
        seed: the request's seed.
    """
    functions = [t["function"] for t in tools]
    if name is None:
        function = functions[prompt_seed(prompt_token_ids, seed) % len(functions)]
    else:
        function = next(f for f in functions if f["name"] == name)
    arguments = simulated_arguments(function.get("parameters"), prompt_token_ids, seed)
    finish: ToolFinish = "tool_calls" if name is None else "stop"
    return ToolCallAnswer(function["name"], json.dumps(arguments, ensure_ascii=False), finish)


def simulated_arguments(schema: Any, prompt_token_ids: Sequence[int], seed: int = 0) -> Any:
    """A value of ``schema`` (a JSON schema; a function's ``parameters``), fixed by the
    prompt and seed: an object gets its required properties, each a value of its own
    schema; a string is a pseudo-word, an integer or number a small integer, a boolean
    from the hash; ``enum`` and ``const`` give one of theirs; ``anyOf``/``oneOf`` the
    first choice; an array one item. A missing schema is an empty object."""
    base = prompt_seed(prompt_token_ids, seed)
    counter = iter(range(1 << 30))

    def draw() -> int:
        return xxhash.xxh64_intdigest(struct.pack("<I", next(counter)), base)

    def value(s: Any, depth: int) -> Any:
        if not isinstance(s, dict):
            return {}
        if "const" in s:
            return s["const"]
        if isinstance(s.get("enum"), list) and s["enum"]:
            return s["enum"][draw() % len(s["enum"])]
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(s.get(key), list) and s[key]:
                return value(s[key][0], depth)
        kind = s.get("type", "object" if "properties" in s else "string")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if kind == "object":
            if depth >= _MAX_DEPTH:
                return {}
            properties = s.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            required = s.get("required")
            names = (
                [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
            )
            return {n: value(properties.get(n, {}), depth + 1) for n in names}
        if kind == "array":
            return [] if depth >= _MAX_DEPTH else [value(s.get("items", {}), depth + 1)]
        if kind in ("integer", "number"):
            return draw() % 100
        if kind == "boolean":
            return bool(draw() % 2)
        if kind == "null":
            return None
        return WORDS[draw() % len(WORDS)].strip()

    return value(schema if schema is not None else {"type": "object"}, 0)
