"""Request -> the exact token ids vLLM will prefill, cheaply.

Rendering follows vLLM (which calls Hugging Face ``apply_chat_template``): the model's
``chat_template`` from ``tokenizer_config.json``, in HF's sandboxed jinja2 environment
(``request.chat_template``), given the messages, tools and variables ``request.chat_input``
builds from a chat or responses request as vLLM does, and the special tokens; continuing
the final message renders it with a marker and cuts there, as HF does. The text is then
tokenized without added special tokens. A completions prompt is tokenized as is, with
them; a prompt of token ids is taken as sent.

Tokenizing is the cost of exactness, so a prompt is never tokenized whole: the
tokenizer splits its added tokens (``<|im_start|>``...) out of the text before
normalizing and pre-tokenizing, so the text between two of them tokenizes
independently of the rest. ``SegmentTokenizer`` cuts there, looks each segment up in a
memo bounded by total tokens (a conversation's history, a shared system prompt, are
tokenized once) and encodes the rest in one ``encode_batch`` call (Rust, GIL released).
``tests/request/test_tokens.py`` proves the rule against whole-prompt tokenization.

Cutting (``segments``: render, split, look up) is cheap and says what is left to encode;
encoding (``encode``) may be slow and runs on any thread: the memo is shared under a
lock that is never held while the tokenizer works, so a caller can cut a request on the
gRPC loop and encode it elsewhere only when segments are missing.

Requests that cannot be rendered exactly (multimodal parts, a template error, a model
without a tokenizer, gpt-oss's harmony format: ``chat_input``) raise ``NotExact``; the
caller falls back to the approximate view.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from extproc.request.chat_input import (
    ChatInput,
    NotExact,
    chat_input,
    developer_to_system,
    responses_input,
)
from extproc.request.chat_template import compile_template
from extproc.request.parse import Api

__all__ = ["NotExact", "SegmentTokenizer", "TokenIds"]

DEFAULT_MEMO_TOKENS = 4_000_000  # bounds the memo's memory: 4 bytes a token id
MAX_TOKEN_ID = 2**32 - 1  # ids are hashed as 4-byte integers
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # Hugging Face's marker, cut off again


def _special_token(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class Segments:
    """A prompt cut at its added tokens, ready to encode."""

    prefix: Sequence[int]  # ids before the text: a completion's BOS, or a token-id prompt
    parts: Sequence[str]  # even positions: text segments; odd: the added tokens between
    missing: Sequence[str]  # text segments not in the memo when cut, each once


TokenIds = npt.NDArray[np.uint32]  # a prompt's token ids: 4 bytes each, as keys hash them


def as_ids(ids: Sequence[int]) -> TokenIds:
    """``ids`` as a read-only array (memo entries are shared by every request)."""
    array = np.array(ids, dtype=np.uint32)
    array.flags.writeable = False
    return array


_NO_IDS = as_ids(())


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
        try:
            self.template = compile_template(template) if isinstance(template, str) else None
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        # vLLM's own test (``_detect_developer_role_support``)
        self.developer_role = isinstance(template, str) and (
            '"developer"' in template or "'developer'" in template
        )
        try:
            model_type = json.loads((path / "config.json").read_text("utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        self.harmony = model_type == "gpt_oss"  # vLLM renders gpt-oss its own way
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
        self._added_ids = {token: as_ids([token_id]) for token, token_id in self.added.items()}
        longest_first = sorted(self.added, key=len, reverse=True)
        # "()" would split between every character: without added tokens, never split
        alternatives = "|".join(map(re.escape, longest_first)) or "(?!)"
        self._split = re.compile(f"({alternatives})")
        prefix = self.tokenizer.encode("", add_special_tokens=True).ids
        with_prefix = self.tokenizer.encode("a", add_special_tokens=True).ids
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        # Tokens the post-processor adds, when they are only a prefix (a BOS).
        self._completion_prefix: list[int] | None = (
            prefix if with_prefix == prefix + plain else None
        )
        self.memo_tokens = memo_tokens
        # Arrays, not lists: a request's ids are their concatenation, where building an
        # array from a list of ints is about 35 ns an id.
        self._memo: OrderedDict[str, TokenIds] = OrderedDict()
        self._memo_size = 0
        self._lock = threading.Lock()  # the memo and its counts; never held while encoding
        self.hits = 0
        self.misses = 0

    # Rendering ---------------------------------------------------------------------

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """A chat request's prompt text; raises ``NotExact``."""
        return self.render(chat_input(body))

    def render_responses(self, body: Mapping[str, Any]) -> str:
        """A responses request's prompt text; raises ``NotExact``."""
        return self.render(responses_input(body))

    def render(self, chat: ChatInput) -> str:
        """The template rendered as Hugging Face's ``apply_chat_template`` renders it."""
        if self.template is None:
            raise NotExact("the model has no chat template")
        if self.harmony:
            raise NotExact("gpt-oss prompts are rendered in the harmony format")
        messages = chat.messages if self.developer_role else developer_to_system(chat.messages)
        if chat.continue_final:
            final = messages[-1]["content"]
            messages = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]
        try:
            text = self.template.render(
                **{**self.special_tokens, **chat.variables},
                messages=messages,
                tools=chat.tools,
            )
        except Exception as exc:  # noqa: BLE001 (a template can raise anything; vLLM answers 400)
            raise NotExact(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        if chat.continue_final:
            marker = CONTINUE_TAG.strip()
            if final.strip() not in text or marker not in text:
                raise NotExact("the template drops part of the message to continue")
            cut = text.rindex(marker)
            keep = text[:cut]
            text = keep if text[cut : cut + len(CONTINUE_TAG)] == CONTINUE_TAG else keep.rstrip()
        return text

    def request_tokens(self, api: Api, body: Mapping[str, Any]) -> list[int]:
        """The prompt's token ids as vLLM prefills them; raises ``NotExact``."""
        ids: list[int] = self.encode(self.segments(api, body)).tolist()
        return ids

    def segments(self, api: Api, body: Mapping[str, Any]) -> Segments:
        """The request's prompt rendered and cut (cheap); raises ``NotExact``."""
        if api is Api.CHAT_COMPLETIONS:
            return self.split(self.render_chat(body))
        if api is Api.RESPONSES:
            return self.split(self.render_responses(body))
        if api is Api.COMPLETIONS:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                if not (0 <= min(prompt) and max(prompt) <= MAX_TOKEN_ID):
                    raise NotExact("a token id is out of range")
                return Segments(prompt, (), ())
            if not isinstance(prompt, str) or self._completion_prefix is None:
                raise NotExact("only a single string or token-id prompt is tokenized")
            return self.split(prompt, self._completion_prefix)
        raise NotExact(f"{api.value} is not rendered exactly")

    # Tokenizing --------------------------------------------------------------------

    def tokens(self, text: str) -> list[int]:
        """``text``'s ids without added special tokens, segment by segment."""
        ids: list[int] = self.encode(self.split(text)).tolist()
        return ids

    def split(self, text: str, prefix: Sequence[int] = ()) -> Segments:
        """``text`` cut at the added tokens, and which of its segments the memo lacks."""
        parts = self._split.split(text)  # odd positions: the added tokens themselves
        memo = self._memo  # a membership test is one atomic dict lookup: no lock
        missing = [p for p in dict.fromkeys(parts[::2]) if p and p not in memo]
        return Segments(prefix, parts, missing)

    def encode(self, segments: Segments) -> TokenIds:
        """The ids of ``segments``: the memo's, and the missing ones encoded in one batch
        (on the calling thread; the memo is locked only to read and fill it)."""
        parts = segments.parts
        with self._lock:  # another thread may have encoded some since the cut
            missing = [p for p in segments.missing if p not in self._memo]
        if missing:
            encoded = self.tokenizer.encode_batch_fast(missing, add_special_tokens=False)
            with self._lock:
                for segment, enc in zip(missing, encoded, strict=True):
                    self._remember(segment, enc.ids)
        arrays: list[TokenIds] = [as_ids(segments.prefix)] if segments.prefix else []
        lost: list[tuple[int, str]] = []  # segments the memo lost meanwhile, by their place
        added = self._added_ids
        with self._lock:
            memo = self._memo
            num_segments = 0  # the text segments, found in the memo or lost
            for i, part in enumerate(parts):
                if i % 2:
                    arrays.append(added[part])
                elif part:
                    ids = memo.get(part)
                    if ids is None:  # evicted by later inserts (this call's, or another's)
                        lost.append((len(arrays), part))
                        arrays.append(_NO_IDS)  # its place, filled below
                    else:
                        memo.move_to_end(part)
                        arrays.append(ids)
                    num_segments += 1
            self.misses += len(missing)
            self.hits += num_segments - len(missing)
        for at, part in lost:  # encoded again here, outside the lock
            arrays[at] = as_ids(self.tokenizer.encode(part, add_special_tokens=False).ids)
        return np.concatenate(arrays) if arrays else as_ids(())

    @property
    def memo_size(self) -> int:
        """What ``memo_tokens`` bounds: the memo's tokens plus one per segment."""
        return self._memo_size

    def _remember(self, segment: str, ids: list[int]) -> None:
        self._memo[segment] = as_ids(ids)
        self._memo_size += len(ids) + 1
        while self._memo_size > self.memo_tokens and self._memo:
            _, old = self._memo.popitem(last=False)
            self._memo_size -= len(old) + 1
