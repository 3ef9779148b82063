"""Request -> the exact token ids vLLM will prefill, cheaply.

Rendering follows vLLM (which calls Hugging Face ``apply_chat_template``): the model's
``chat_template`` from ``tokenizer_config.json``, in a sandboxed jinja2 environment with
``trim_blocks``, ``lstrip_blocks``, loop controls, HF's ``tojson`` and
``raise_exception``, given ``messages`` (text parts joined with a newline, as vLLM does
for string-content templates), ``tools``, ``add_generation_prompt`` (default true),
``chat_template_kwargs`` and the special tokens; the text is then tokenized without
added special tokens. A completions prompt is tokenized as is, with them; a prompt of
token ids is taken as sent.

Tokenizing is the cost of exactness (about 3 us a token), so a prompt is never
tokenized whole: the tokenizer splits its added tokens (``<|im_start|>``...) out of the
text before normalizing and pre-tokenizing, so the text between two of them tokenizes
independently of the rest. ``SegmentTokenizer`` cuts there, looks each segment up in a
memo bounded by total tokens (a conversation's history, a shared system prompt, are
tokenized once) and encodes the rest in one ``encode_batch`` call (Rust, GIL released).
``tests/request/test_tokens.py`` proves the rule against whole-prompt tokenization.

Requests that cannot be rendered exactly (multimodal parts, a template error, a model
without a tokenizer) raise ``NotExact``; the caller falls back to the approximate view.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from extproc.request.parse import Api

DEFAULT_MEMO_TOKENS = 4_000_000  # about 100 MB of token ids in Python lists at most


class NotExact(Exception):
    """The request cannot be tokenized as the engine will; the message says why."""


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _special_token(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class SegmentTokenizer:
    """One model's template and tokenizer, with the per-segment memo."""

    def __init__(self, directory: str | Path, memo_tokens: int = DEFAULT_MEMO_TOKENS) -> None:
        path = Path(directory)
        try:
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            config = json.loads((path / "tokenizer_config.json").read_text("utf-8"))
        except Exception as exc:  # noqa: BLE001 (tokenizers raises a plain Exception)
            raise ValueError(f"{path}: cannot load the tokenizer: {exc}") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template) if isinstance(template, str) else None
        self.special_tokens = {
            name: token
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (token := _special_token(config.get(name))) is not None
        }
        # The added tokens split out before pre-tokenizing (no strip flags, matched raw).
        self.added: dict[str, int] = {
            t.content: token_id
            for token_id, t in self.tokenizer.get_added_tokens_decoder().items()
            if not (t.lstrip or t.rstrip or t.single_word or t.normalized)
        }
        longest_first = sorted(self.added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
        prefix = self.tokenizer.encode("", add_special_tokens=True).ids
        with_prefix = self.tokenizer.encode("a", add_special_tokens=True).ids
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        # Tokens the post-processor adds, when they are only a prefix (a BOS).
        self._completion_prefix: list[int] | None = (
            prefix if with_prefix == prefix + plain else None
        )
        self.memo_tokens = memo_tokens
        self._memo: OrderedDict[str, list[int]] = OrderedDict()
        self._memo_size = 0
        self.hits = 0
        self.misses = 0

    # Rendering ---------------------------------------------------------------------

    def render_chat(self, body: Mapping[str, Any]) -> str:
        if self.template is None:
            raise NotExact("the model has no chat template")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise NotExact("no messages")
        kwargs = body.get("chat_template_kwargs")
        try:
            return self.template.render(
                messages=[_message(m) for m in messages],
                tools=body.get("tools"),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                **self.special_tokens,
                **(kwargs if isinstance(kwargs, dict) else {}),
            )
        except Exception as exc:  # noqa: BLE001 (the client's data runs the template: a
            # clash with its own kwargs is a TypeError, iterating a bad `tools` too)
            raise NotExact(f"the chat template failed: {exc}") from None

    def request_tokens(self, api: Api, body: Mapping[str, Any]) -> list[int]:
        """The prompt's token ids as vLLM prefills them; raises ``NotExact``."""
        if api is Api.CHAT_COMPLETIONS:
            return self.tokens(self.render_chat(body))
        if api is Api.COMPLETIONS:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return list(prompt)
            if not isinstance(prompt, str) or self._completion_prefix is None:
                raise NotExact("only a single string or token-id prompt is tokenized")
            return self._completion_prefix + self.tokens(prompt)
        raise NotExact(f"{api.value} is not rendered exactly")

    # Tokenizing --------------------------------------------------------------------

    def tokens(self, text: str) -> list[int]:
        """``text``'s ids without added special tokens, segment by segment."""
        parts = self._split.split(text)  # odd positions: the added tokens themselves
        missing = [p for i, p in enumerate(parts) if i % 2 == 0 and p and p not in self._memo]
        if missing:
            unique = list(dict.fromkeys(missing))
            encoded = self.tokenizer.encode_batch_fast(unique, add_special_tokens=False)
            for segment, enc in zip(unique, encoded, strict=True):
                self._remember(segment, enc.ids)
        self.misses += len(missing)
        out: list[int] = []
        memo = self._memo
        for i, part in enumerate(parts):
            if i % 2:
                out.append(self.added[part])
            elif part:
                ids = memo.get(part)
                if ids is None:  # evicted by this very call's inserts
                    ids = self.tokenizer.encode(part, add_special_tokens=False).ids
                else:
                    memo.move_to_end(part)
                out.extend(ids)
        self.hits += sum(1 for i, p in enumerate(parts) if i % 2 == 0 and p) - len(missing)
        return out

    def _remember(self, segment: str, ids: list[int]) -> None:
        self._memo[segment] = ids
        self._memo_size += len(ids) + 1
        while self._memo_size > self.memo_tokens and self._memo:
            _, old = self._memo.popitem(last=False)
            self._memo_size -= len(old) + 1


def _message(message: Any) -> dict[str, Any]:
    """vLLM's message as a string-content template sees it: text parts joined by newlines."""
    if not isinstance(message, dict):
        raise NotExact("a message is not an object")
    content = message.get("content")
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                raise NotExact("a message has a non-text (multimodal) part")
            texts.append(str(part.get("text", "")))
        message = {**message, "content": "\n".join(texts)}
    elif content is None and message.get("role") != "assistant":
        message = {**message, "content": ""}
    return dict(message)
