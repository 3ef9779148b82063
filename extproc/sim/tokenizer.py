"""A deterministic pseudo-tokenizer, Qwen3's chat template and the simulated output.

Tokens. Text is encoded as UTF-8 and cut into 4-byte chunks, the last of which may be
shorter; each chunk is one token, ``XXH32(chunk) mod TEXT_VOCAB_SIZE``. So the same text
always gives the same tokens, in every process, and about 4 bytes make a token.

Prefix property. If text ``b`` starts with text ``a`` (as bytes), then
``tokenize(b)[:k] == tokenize(a)[:k]`` with ``k = len(a.encode()) // 4``: every full chunk
of ``a`` is shared. When ``a``'s length in bytes is a multiple of 4 (``a`` ends at a
4-byte boundary), ``tokenize(a)`` is a prefix of ``tokenize(b)``; otherwise ``a``'s last,
partial chunk becomes a different token in ``b``.

Chat. ``render_chat`` renders as Qwen3's chat template (ChatML:
``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n`` for
the answer), tools included: the tool catalog in a first system block (after the system
message's text, with the template's instructions), one JSON object a line; an assistant's
``tool_calls`` as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` after its
content; tool messages as ``<tool_response>`` blocks, consecutive ones in one user turn. As
in that template, ids (``tool_call_id``, a call's ``id``) are not rendered, nor a message
of a role other than system, user, assistant and tool. Each piece the
template writes is tokenized on its own, with the special tokens in it (``SPECIAL_IDS``,
Qwen's ids) atomic, the way real tokenizers split added tokens out first. Pieces never
share a chunk, so rendering messages 1..n+1 extends the tokens of messages 1..n, whatever
the byte lengths, as long as the tools stay the same (and except between two tool
messages, which share one turn).

Output. ``generate_words`` returns the "model's" answer: 4-byte ASCII words (three
letters and a space), one token each, chosen by hashing the prompt's tokens and a seed.
Words are 4 bytes, so an answer re-tokenizes to exactly the tokens generated; sent back
as the assistant message of the next turn, it re-renders to the tokens the engine
produced (and cached), which is what makes the next turn hit the cache as in vLLM.
A tool call (``tool_calls.py``) is answered with the words ``split_words`` cuts from its
rendered text, so it re-renders to the tokens generated too.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import xxhash

CHUNK_BYTES = 4
TEXT_VOCAB_SIZE = 151_643  # ids 0..151642 are text; the specials follow, as in Qwen
ENDOFTEXT = 151_643
IM_START = 151_644
IM_END = 151_645
TOOL_CALL = 151_657
TOOL_CALL_END = 151_658
TOOL_RESPONSE = 151_665
TOOL_RESPONSE_END = 151_666
VOCAB_SIZE = 151_669  # Qwen3's tokenizer: its added tokens end at 151668
SPECIAL_TEXT = {
    ENDOFTEXT: "<|endoftext|>",
    IM_START: "<|im_start|>",
    IM_END: "<|im_end|>",
    TOOL_CALL: "<tool_call>",
    TOOL_CALL_END: "</tool_call>",
    TOOL_RESPONSE: "<tool_response>",
    TOOL_RESPONSE_END: "</tool_response>",
}
SPECIAL_IDS = {text: token_id for token_id, text in SPECIAL_TEXT.items()}
_SPECIAL_SPLIT = re.compile("(" + "|".join(map(re.escape, SPECIAL_IDS)) + ")")
# Qwen3's template, word for word, around the tool catalog.
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)

_CONSONANTS = "bcdfghjklmnprstvz"
_VOWELS = "aeiou"
# 17 * 5 * 17 = 1445 words of exactly 4 ASCII bytes.
WORDS: tuple[str, ...] = tuple(
    a + v + b + " " for a in _CONSONANTS for v in _VOWELS for b in _CONSONANTS
)

_xxh32 = xxhash.xxh32_intdigest
_xxh64 = xxhash.xxh64_intdigest


class ToolCall(NamedTuple):
    name: str
    arguments: str  # JSON text, as the template writes it


class ChatMessage(NamedTuple):
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's


def tokenize(text: str) -> list[int]:
    """One token per 4-byte chunk of the UTF-8 text (see the module docstring)."""
    data = text.encode()
    return [
        _xxh32(data[i : i + CHUNK_BYTES]) % TEXT_VOCAB_SIZE
        for i in range(0, len(data), CHUNK_BYTES)
    ]


def render_chat(
    messages: Sequence[ChatMessage],
    tools: Sequence[Mapping[str, Any]] = (),
    add_generation_prompt: bool = True,
) -> list[int]:
    """Qwen3's chat template, tools included, to tokens (see the module docstring).

    Args:
        messages: the conversation, oldest first.
        tools: the tool catalog, each as the template gets it
            (``{"type": "function", "function": {...}}``).
        add_generation_prompt: end with ``<|im_start|>assistant\\n`` for the answer.

    Returns:
        The prompt's token ids.
    """
    pieces = chat_pieces(messages, tools, add_generation_prompt)
    return [token for piece in pieces for token in _encode_piece(piece)]


# The roles Qwen3's template renders; it skips a message of any other role.
_TEMPLATE_ROLES = frozenset({"system", "user", "assistant", "tool"})


def chat_pieces(
    messages: Sequence[ChatMessage],
    tools: Sequence[Mapping[str, Any]] = (),
    add_generation_prompt: bool = True,
) -> list[str]:
    """The text ``render_chat`` tokenizes, in the pieces it tokenizes one by one; joined,
    the text Qwen3's template renders."""
    pieces: list[str] = []
    if tools:  # the system message's text goes first in the tools block
        pieces.append("<|im_start|>system\n")
        if messages and messages[0].role == "system":
            pieces.append(messages[0].content + "\n\n")
            messages = messages[1:]
        pieces.append(TOOLS_HEADER)
        pieces += ["\n" + json.dumps(tool, ensure_ascii=False) for tool in tools]
        pieces.append(TOOLS_FOOTER)
    for i, message in enumerate(messages):
        if message.role not in _TEMPLATE_ROLES:
            continue
        if message.role == "tool":
            if i == 0 or messages[i - 1].role != "tool":
                pieces.append("<|im_start|>user")
            pieces.append("\n<tool_response>\n" + message.content + "\n</tool_response>")
            if i + 1 == len(messages) or messages[i + 1].role != "tool":
                pieces.append("<|im_end|>\n")
            continue
        pieces += [f"<|im_start|>{message.role}\n", message.content]
        for j, call in enumerate(message.tool_calls):
            if j or message.content:
                pieces.append("\n")
            pieces.append(tool_call_text(call))
        pieces.append("<|im_end|>\n")
    if add_generation_prompt:
        pieces.append("<|im_start|>assistant\n")
    return pieces


def tool_call_text(call: ToolCall) -> str:
    """An assistant's tool call as the template writes it (and the model answers it)."""
    return f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n</tool_call>'


def _encode_piece(piece: str) -> list[int]:
    """One piece of a rendering: its special tokens atomic, the text between tokenized."""
    tokens: list[int] = []
    for i, part in enumerate(_SPECIAL_SPLIT.split(piece)):
        tokens += [SPECIAL_IDS[part]] if i % 2 else tokenize(part)
    return tokens


def split_words(piece: str) -> list[str]:
    """``piece`` cut as ``_encode_piece`` cuts it, one word a token (``word_token``).

    A 4-byte chunk may end inside a character; its word keeps the bytes (surrogate
    escapes), so the words joined are the text only once encoded back.
    """
    words: list[str] = []
    for i, part in enumerate(_SPECIAL_SPLIT.split(piece)):
        if i % 2:
            words.append(part)
            continue
        data = part.encode()
        words += [
            data[k : k + CHUNK_BYTES].decode(errors="surrogateescape")
            for k in range(0, len(data), CHUNK_BYTES)
        ]
    return words


def prompt_seed(prompt_token_ids: Sequence[int], seed: int = 0) -> int:
    """A 64-bit digest of the prompt's tokens and ``seed``: the output's only input."""
    packed = struct.pack(f"<{len(prompt_token_ids)}I", *prompt_token_ids)
    return _xxh64(packed, seed & 0xFFFF_FFFF_FFFF_FFFF)


def generate_words(prompt_token_ids: Sequence[int], num_tokens: int, seed: int = 0) -> list[str]:
    """The simulated answer to a prompt: ``num_tokens`` words of 4 ASCII bytes.

    The same prompt and seed give the same answer in every process; ``tokenize`` of the
    joined words gives one token per word.
    """
    base = prompt_seed(prompt_token_ids, seed)
    return [WORDS[_xxh64(struct.pack("<I", i), base) % len(WORDS)] for i in range(num_tokens)]


def word_token(word: str) -> int:
    """The token id of one generated word: a special token, or a chunk of at most 4 bytes
    (``split_words``)."""
    special = SPECIAL_IDS.get(word)
    if special is not None:
        return special
    return _xxh32(word.encode(errors="surrogateescape")) % TEXT_VOCAB_SIZE
